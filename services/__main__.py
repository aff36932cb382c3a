"""`python -m services ...` is the `pagedserve` command."""

import sys

from services.cli.main import main

# Guarded: the rank processes of a multi-process engine are spawned, and a spawned child
# imports the parent's main module (as __mp_main__) before running its target.
if __name__ == "__main__":
    sys.exit(main())
