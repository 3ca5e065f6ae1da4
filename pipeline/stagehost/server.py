"""The HTTP endpoint of a stage process: ``/metrics``, ``/healthz`` and ``/readyz``.

A WSGI server on its own daemon thread, so a scrape or a probe never waits for the
event loop, and a busy event loop never delays a scrape. That is also why liveness
is not "the server answers": ``/healthz`` answers 503 once the consumer loop stopped
ticking (``Health``), which is what an orchestrator should restart for.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any, Self
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from pipeline.stagehost.metrics import Health, StageMetrics

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scraper never holds the process open


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Access lines go to debug logging, not stderr: probes hit every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http: " + format, *args)


def metrics_app(metrics: StageMetrics) -> WsgiApp:
    """``/metrics`` (Prometheus text format), ``/healthz`` (live) and ``/readyz`` (ready)."""
    exposition = make_wsgi_app(metrics.registry)
    probes: dict[str, Callable[[Health], bool]] = {
        "/healthz": lambda health: health.live,
        "/readyz": lambda health: health.ready,
    }

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            scraped: Iterable[bytes] = exposition(environ, start_response)
            return scraped
        probe = probes.get(path)
        if probe is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics, /healthz or /readyz\n"]
        ok = probe(metrics.health)
        body = f"{'ok' if ok else 'unavailable'} (loop silent for {metrics.health.silent_for_s:.1f}s)\n"
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [body.encode()]

    return app


class MetricsServer:
    """Serves one ``StageMetrics`` on ``host:port`` until stopped.

    ``port=0`` takes a free port (read it back from ``port``); the command line
    treats 0 as "no server" instead, so a deployment never listens by accident.
    """

    def __init__(self, metrics: StageMetrics, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("MetricsServer is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        if self._server is not None:
            return
        server_class = _Server6 if ":" in self.host else _Server
        server = make_server(
            self.host,
            self.requested_port,
            metrics_app(self.metrics),
            server_class=server_class,
            handler_class=_QuietHandler,
        )
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread
        log.info("metrics on %s/metrics", self.url)

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
