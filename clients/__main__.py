"""`python -m clients ...`: the client subcommands of `pagedserve` (generate, chat, tokenize,
health, bench) without the server's; needs no torch."""

import sys

from clients.cli import main

sys.exit(main())
