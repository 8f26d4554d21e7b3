from cactus_cli.cli.main import main

main()
