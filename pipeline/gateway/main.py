"""Wiring of one gateway process: sessions, worker pool, HTTP client to the workers, server.

The event sink arrives as a ``stages.ports.EventSink`` (in production the Kafka sink), so
tests can pass an in-memory one. The server is the worker's in-loop uvicorn
(``WorkerServer``); SIGTERM/SIGINT stop it after in-flight calls finish.

Given the Kafka config, a gateway rebuilds its sessions from its bookmark at start and
commits the bookmark while it serves (``bookmark``). A replica (``replica`` named) rebuilds
nothing at start: it takes over, from the log, each rollout it is asked for and does not
hold (``recovery.take_over``), so any replica can continue any episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI

from pipeline.auth.capability import AgentCapabilities
from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.transport import TlsFiles, check_bind, client_verify
from pipeline.gateway.app import create_gateway_app
from pipeline.gateway.bookmark import Bookmark
from pipeline.gateway.calls import Forwarder
from pipeline.gateway.pacing import AdmissionPacer, Pacing
from pipeline.gateway.quotas import Quotas
from pipeline.gateway.recovery import recover, still_ours, take_over
from pipeline.gateway.sessions import Session, Sessions
from pipeline.gateway.upstream import Workers
from pipeline.kafka.config import KafkaConfig
from pipeline.worker import DEFAULT_MAX_BODY_BYTES
from pipeline.worker.main import WorkerServer, stop_on_signals
from stages.client import RolloutClient
from stages.ports import EventSink
from topics.records import SamplePolicy

_REPLICA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
"""A replica's name, part of its consumer group's."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    workers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    session_ttl_s: float = 600.0
    remember_sealed: int = 10_000
    """Sealed sessions kept (the latest), to show and for 409s."""
    sample_policy: SamplePolicy = "terminal"
    """For seals that do not name one (DESIGN §4.4)."""
    sweep_every_s: float = 5.0
    call_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    kafka: KafkaConfig | None = None
    """Where to rebuild sessions from at start (``recovery``); None starts empty."""
    replica: str | None = None
    """This replica's name among several serving one address: sessions are taken over
    from the log on demand, and its bookmark is its own (None: the only gateway)."""
    max_open_s: float = 3600.0
    """The ledger's ``max_open``: a rollout unsealed this long after its first call is closed
    ``never_sealed``, so it is neither rebuilt nor holds the bookmark back."""
    checkpoint_every_s: float = 30.0
    """How often the bookmark is committed."""
    credentials: Credentials = field(default_factory=Credentials)
    """Checks environment and operator callers, signs agent keys (``agent.key``), and
    presents the service credential to the workers (DESIGN §15)."""
    quotas: Quotas = field(default_factory=Quotas)
    worker_slots: int | None = None
    """Calls each worker runs at once, shared fairly among sessions (``slots``); None: learned
    from each worker's measured speed (``capacity``); 0: no bound."""
    pacing: Pacing | None = None
    """Hold new rollouts back while the trainer is too far behind (None: never)."""
    insecure_no_auth: bool = False
    tls: TlsFiles | None = None
    ssl_cafile: Path | None = None
    """The CA the workers' certificates are verified against (HTTPS workers)."""

    def __post_init__(self) -> None:
        if self.replica is not None and not _REPLICA.fullmatch(self.replica):
            raise ValueError(f"replica: {self.replica[:80]!r} does not match {_REPLICA.pattern}")
        if self.worker_slots is not None and self.worker_slots < 0:
            raise ValueError(f"worker_slots: must be >= 0 (0: no bound), got {self.worker_slots}")
        for name in ("max_open_s", "checkpoint_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Gateway:
    app: FastAPI
    sessions: Sessions
    forwarder: Forwarder
    bookmark: Bookmark | None = None


@contextlib.asynccontextmanager
async def gateway(
    config: GatewayConfig, sink: EventSink, *, client: RolloutClient | None = None
) -> AsyncIterator[Gateway]:
    """The gateway's app and state; its HTTP client to the workers closes on exit.

    ``client`` publishes admissions and seals (default: a plain one on ``sink``).
    """
    client = client if client is not None else RolloutClient(sink)
    sessions = Sessions(
        client,
        ttl_s=config.session_ttl_s,
        sample_policy=config.sample_policy,
        remember_sealed=config.remember_sealed,
    )
    timeout = httpx.Timeout(config.call_timeout_s, connect=5.0)
    credentials = config.credentials
    async with httpx.AsyncClient(
        timeout=timeout,
        trust_env=False,
        headers=credentials.authorization(Role.SERVICE),
        verify=client_verify(config.ssl_cafile),
    ) as http:
        bookmark = None if config.kafka is None else await _recovered(config, sessions)
        workers = Workers(config.workers, slots=config.worker_slots)
        forwarder = Forwarder(client, workers, http)
        pacer = None if config.pacing is None else AdmissionPacer(config.pacing, lambda: workers.urls, http)
        app = create_gateway_app(
            sessions,
            forwarder,
            sweep_every_s=config.sweep_every_s,
            max_body_bytes=config.max_body_bytes,
            credentials=credentials,
            capabilities=AgentCapabilities(credentials.agent_key),
            quotas=config.quotas,
            pacer=pacer,
        )
        if bookmark is None:
            yield Gateway(app, sessions, forwarder)
            return
        committer = asyncio.create_task(bookmark.advance_forever(config.checkpoint_every_s))
        try:
            yield Gateway(app, sessions, forwarder, bookmark)
        finally:
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer


async def _recovered(config: GatewayConfig, sessions: Sessions) -> Bookmark:
    """Sessions rebuilt from the bookmark (a replica: ready to take them over), and the
    bookmark committed before any new session opens."""
    kafka = config.kafka
    assert kafka is not None
    bookmark = Bookmark(kafka, sessions, replica=config.replica, max_open_s=config.max_open_s)
    start = await bookmark.start()
    if config.replica is None:
        await recover(kafka, sessions, start=start, max_open_s=config.max_open_s)
    else:
        bookmark.inherit()

        async def take(rollout_id: str) -> None:
            await take_over(kafka, sessions, bookmark, rollout_id)

        async def ours(session: Session) -> bool:
            return await still_ours(kafka, bookmark, session)

        sessions.take_over, sessions.still_ours = take, ours
    await bookmark.advance()
    return bookmark


async def run_gateway(
    config: GatewayConfig, sink: EventSink, *, on_ready: Callable[[str], None] | None = None
) -> None:
    """Serve until SIGTERM/SIGINT (or the server stops)."""
    check_bind(config.host, config.credentials, insecure_no_auth=config.insecure_no_auth, what="gateway")
    async with gateway(config, sink) as built:
        server = WorkerServer(built.app, host=config.host, port=config.port, tls=config.tls)
        with stop_on_signals(server.request_stop):
            await server.start()
            if on_ready is not None:
                on_ready(server.url)
            await server.wait()


__all__ = ["Gateway", "GatewayConfig", "gateway", "run_gateway"]
