"""``python -m tierflow ...``: the command line (see ``tierflow.cli``)."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
