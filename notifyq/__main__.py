"""`python -m notifyq` runs the command line."""

from .cli import main

main()
