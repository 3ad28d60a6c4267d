"""`python -m mpedu`: the command line lives in mpedu.cli."""
import sys

from .cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
