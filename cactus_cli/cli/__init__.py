"""The command line: the Typer app (main.py), the shared options, the Rich UI and one module per
command. Empty on purpose: importing a module of this package imports nothing else."""
