"""Serve a run's page from a DHT node: read the swarm's status records every few seconds, remember them
(:mod:`.history`) and answer HTTP GETs, read-only.

Routes: ``/`` (the page), ``/main`` (its ``<main>``, which the page's script fetches to refresh
itself), ``/api/status`` (the same data as JSON: ``status --json``'s shape, each run with its
``summary`` and ``history``), ``/page.js`` and ``/page.css``. Every other path is a 404; every method
but GET and HEAD is refused. Each response forbids any source but this server
(Content-Security-Policy), so even a string that escaped escaping could not run a script.

The server listens on 127.0.0.1 unless the user names another address. A stranger can announce
runs without end: the page follows at most ``MAX_RUNS`` of them (those with the most peers).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from p2p_diloco.run_page.history import RunHistory
from p2p_diloco.run_page.render import render_main, render_page
from p2p_diloco.swarm.status_report import read_runs

logger = logging.getLogger(__name__)

MAX_RUNS = 16
DEFAULT_REFRESH_S = 10.0  # how often the server reads the DHT, and the page asks for news
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STATIC = {"/page.js": "text/javascript; charset=utf-8", "/page.css": "text/css; charset=utf-8"}


class RunPage:
    """The page of the runs that `read` returns (as :func:`~p2p_diloco.swarm.status_report.read_runs` does),
    served on `host`:`port` (0: any free port).

    :meth:`read_swarm` reads once; the reader thread does it every `refresh_s` seconds. Raises OSError if
    the address cannot be bound.
    """

    def __init__(self, read: Callable[[], list[dict]], host: str, port: int, refresh_s: float = DEFAULT_REFRESH_S):
        self.read, self.refresh_s = read, refresh_s
        self.histories: OrderedDict[str, RunHistory] = OrderedDict()  # least recently seen first
        self._api: dict[str, Any] = dict(time=None, runs=[])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}/"
        self._threads = [threading.Thread(target=self._server.serve_forever, kwargs=dict(poll_interval=0.5),
                                          name="run-page-http", daemon=True),
                         threading.Thread(target=self._read_forever, name="run-page-reader", daemon=True)]
        for thread in self._threads:
            thread.start()

    def read_swarm(self) -> None:
        """Read the runs' status records once, add them to their histories and make them what the page shows."""
        report = self.read()
        now = time.time()
        with self._lock:
            for run in report:
                history = self.histories.pop(run["run"], None) or RunHistory(run["run"])
                history.observe(run["peers"], run["tokens_per_sample"], now)
                self.histories[run["run"]] = history
                run.update(history.as_dict())
            while len(self.histories) > MAX_RUNS:
                self.histories.popitem(last=False)
            self._api = dict(time=now, runs=report)

    def _read_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.read_swarm()
            except Exception as e:  # the DHT may fail for a moment: the page keeps what it had
                logger.warning("the run's page could not read the swarm: %s", e)
            self._stop.wait(self.refresh_s)

    def api(self) -> dict[str, Any]:
        with self._lock:
            return self._api

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join(self.refresh_s + 30)  # bounded: a DHT read has its own timeouts


def _handler_for(page: RunPage) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "p2p-diloco"

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def _answer(self, send_body: bool) -> None:
            path, status = urlsplit(self.path).path, 200
            if path in ("/", "/index.html"):
                body, kind = render_page(page.api(), page.refresh_s).encode(), "text/html; charset=utf-8"
            elif path == "/main":
                body, kind = render_main(page.api()).encode(), "text/html; charset=utf-8"
            elif path == "/api/status":
                body, kind = json.dumps(page.api()).encode(), "application/json"
            elif path in STATIC:
                body, kind = resources.files("p2p_diloco.run_page").joinpath("static", path[1:]).read_bytes(), \
                    STATIC[path]
            else:
                body, kind, status = b"not found\n", "text/plain; charset=utf-8", 404
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in SECURITY_HEADERS.items():
                self.send_header(name, value)
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("run page: %s - %s", self.address_string(), format % args)

    return Handler


def serve_run_page(dht, host: str, port: int, run: Optional[str], refresh_s: float = DEFAULT_REFRESH_S) -> RunPage:
    """Start the page of the runs `dht` sees (or of `run` only); logs where it is. OSError (one line for the
    user) if it cannot listen there."""
    try:
        page = RunPage(lambda: read_runs(dht, run, max_runs=MAX_RUNS), host, port, refresh_s)
    except OSError as e:
        raise OSError(f"cannot serve the run's page on {host}:{port}: {e.strerror or e}") from e
    logger.info("the run's page is at %s (JSON: %sapi/status)%s", page.url, page.url,
                "" if host in ("127.0.0.1", "localhost", "::1") else "; anyone who can reach this address can read it")
    return page
