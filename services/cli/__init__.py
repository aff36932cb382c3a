"""The `pagedserve` command: its subcommands (main), the security and request-cost flags
(secure_flags), and `pagedserve serve`'s supervisor of both services as child processes."""
