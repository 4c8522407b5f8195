"""One log for a node and the processes it forks: one line format, hivemind's lines included, and on a
terminal every line above the progress bar (p2p_diloco.train.display), never through it.

Three things stood in the way:

* hivemind writes its records with its own handler and format (``Nov 25 03:07:13.604 [INFO] ...``) and
  keeps them from the root logger; :func:`setup_logging` sends them through the root logger instead
  (hivemind's ``use_hivemind_log_handler("nowhere")``), at WARNING, or INFO with ``-v``.
* hivemind's DHT and averager run in forked processes (``multiprocessing``), which write to the same
  terminal with the handlers they inherited: tqdm can clear and redraw only the bar of its own process,
  so their lines ran into the bar (``...[sync in 00:00]2026-11-25 03:06:34,313 INFO ...``). On a
  terminal, :func:`forward_child_logs` makes every child forked from then on send its records to the
  node's process, which writes them through its own handlers: above the bar while one is shown.
  Elsewhere (a file, a pipe) each process writes its lines itself, as before.
* logging_redirect_tqdm redirects the root logger's handlers alone: a logger with a handler of its own
  (hivemind's, before) was not redirected.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import pickle
import socket
import sys
import threading

LOG_FORMAT = "%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"
MAX_FORWARDED_BYTES = 60_000  # one record in one datagram (a Unix socket's default buffer is about 200 KB)


def log_to_stderr(verbose: bool, prefix: str = "") -> None:
    """Our format on stderr for every logger that reaches the root logger; DEBUG with `verbose`."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format=LOG_FORMAT.format(prefix=prefix), stream=sys.stderr)


def setup_logging(verbose: bool, prefix: str = "") -> None:
    """A node's logging (bootstrap, peer, status): :func:`log_to_stderr`, hivemind's records in the same
    format (its INFO lines only with `verbose`: noise for a user; its warnings and errors always), and on
    a terminal the records of the processes it forks written by this one (:func:`forward_child_logs`)."""
    log_to_stderr(verbose, prefix)
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")  # its records propagate to the root logger, as any library's
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    if sys.stderr.isatty():
        forward_child_logs()


class _ToParent(logging.Handler):
    """In a forked child: each record, as one datagram, to the process that forked it."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sock.send(portable_record(record))
        except Exception:
            self.handleError(record)


def portable_record(record: logging.LogRecord) -> bytes:
    """`record` pickled with its message and traceback as text (its arguments may not pickle), as at most
    MAX_FORWARDED_BYTES."""
    fields = {key: value for key, value in vars(record).items()
              if value is None or isinstance(value, (str, int, float, bool))}
    message = record.getMessage()
    if record.exc_info:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    fields.update(msg=message[:MAX_FORWARDED_BYTES // 2], args=None, exc_info=None, exc_text=None)
    return pickle.dumps(fields)


FLUSHED = b"flushed"  # not a pickle: the datagram flush_child_logs sends itself


def _write_forwarded(sock: socket.socket) -> None:
    """In the node's process: each child's record through the root logger's handlers of the moment (the
    bar's redirect while a bar is shown)."""
    while True:
        try:
            data = sock.recv(MAX_FORWARDED_BYTES)
            if data == FLUSHED:
                _forwarding["flushed"].set()
                continue
            record = logging.makeLogRecord(pickle.loads(data))
        except OSError:
            return
        except Exception:  # a torn or foreign datagram: skip it
            continue
        for handler in list(logging.root.handlers):
            if record.levelno >= handler.level:
                handler.handle(record)


_forwarding: dict = {}  # the after-fork hook's key (multiprocessing keeps its hooks in a weak dictionary)


def forward_child_logs() -> None:
    """Every multiprocessing child forked from now on sends its log records to this process (its root
    logger's handlers are replaced by one that does), which writes them. Idempotent."""
    if _forwarding:
        return
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)  # a datagram never interleaves

    def in_child(_key) -> None:
        receiver.close()
        logging.root.handlers = [_ToParent(sender)]

    threading.Thread(target=_write_forwarded, args=(receiver,), name="child-logs", daemon=True).start()
    _forwarding.update(sender=sender, flushed=threading.Event(), key=type("ChildLogs", (), {})())
    multiprocessing.util.register_after_fork(_forwarding["key"], in_child)


def flush_child_logs(timeout_s: float = 2.0) -> None:
    """Wait until the records the children have sent so far are written (one socket queues them all, in
    order): a node calls it once its children are stopped, so that their last lines are not lost."""
    if not _forwarding:
        return
    _forwarding["flushed"].clear()
    _forwarding["sender"].send(FLUSHED)
    _forwarding["flushed"].wait(timeout_s)
