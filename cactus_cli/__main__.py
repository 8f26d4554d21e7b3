from cactus_cli.cli import main

main()
