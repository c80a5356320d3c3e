"""`mamba-draft`: the command line over every package (the console script runs `commands.cli.main`)."""
from mamba_draft.commands.cli import main

__all__ = ["main"]
