"""Parse a `p2p-diloco` command line as click would, without running it: for the commands that the docs and
the docker files show (tests/test_readme.py, tests/test_docker.py)."""

from __future__ import annotations

import click

from p2p_diloco.cli import main


def subcommand_context(args: list[str]) -> click.Context:
    """Parse `p2p-diloco ARGS` as click would, without running the command: bad flags and values raise."""
    parent = main.make_context("p2p-diloco", list(args))
    command = main.get_command(parent, args[0])
    assert command is not None, f"no command {args[0]!r}"
    return command.make_context(args[0], list(args[1:]), parent=parent)
