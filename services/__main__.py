"""`python -m services ...` is the `pagedserve` command."""

import sys

from services.cli import main

sys.exit(main())
