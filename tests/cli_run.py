"""Run a `p2p-diloco` command in the test's own process, as a process of its own would run it: for a command
that ends before it starts a node (a one-line error, a report), which would otherwise pay seconds of imports
in a new process to print a few lines."""

from __future__ import annotations

import logging
import subprocess
import traceback
from contextlib import contextmanager

from click.testing import CliRunner


def invoke_cli(*args: str) -> subprocess.CompletedProcess:
    """`p2p-diloco ARGS` run by its click group in this process, for a command that stops before it starts
    a node: its exit status, stdout and stderr as `python -m p2p_diloco.cli ARGS` has them, its log lines and
    an uncaught exception's traceback included."""
    from p2p_diloco.cli import main

    with logging_of_its_own():
        result = CliRunner().invoke(main, list(args), prog_name="p2p-diloco")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))  # as Python prints it on exit
    return subprocess.CompletedProcess(["p2p-diloco", *args], result.exit_code, result.stdout, stderr)


@contextmanager
def logging_of_its_own():
    """The root logger without handlers while the block runs, as in a new process (a command's
    setup_logging then writes to its stderr); the root and hivemind loggers as they were after it."""
    import hivemind.utils.logging as hivemind_logging

    root, hivemind_logger = logging.getLogger(), logging.getLogger("hivemind")
    mode = hivemind_logging._current_mode  # where hivemind's own handler is: setup_logging moves it
    saved = [(logger, logger.handlers, logger.level, logger.propagate) for logger in (root, hivemind_logger)]
    root.handlers, hivemind_logger.handlers = [], list(hivemind_logger.handlers)
    try:
        yield
    finally:
        hivemind_logging.use_hivemind_log_handler(mode)
        for logger, handlers, level, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
