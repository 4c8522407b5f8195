"""The exit statuses of the commands (the README's table lists each), and the one-line error that ends a
command with one of them. An unexpected error exits with 1 and its traceback: it has no constant."""

from __future__ import annotations

import sys

EXIT_OK, EXIT_USAGE, EXIT_UNREACHABLE = 0, 2, 3
EXIT_OTHER_SETTINGS = 4  # the run's peers train with other settings: this peer can never average with them
EXIT_NO_STATE = 5  # the run is ahead and nothing served its state: training would fork it (train/catch_up.py)
EXIT_ISLAND_BROKEN = 6  # a rank of this peer's island failed (train/island.py)


def fail(message: str, code: int) -> int:
    """Print ``error: <message>`` on stderr and return `code`, the command's exit status."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
