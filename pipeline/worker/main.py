"""Wiring of one worker process: engine, capture core on the given ports, HTTP server.

The data plane and the event sink arrive as ``stages.ports`` implementations (in
production ``pipeline.kafka.KafkaEventSink`` and the TransferQueue data plane), so
what they connect to is decided by the caller and tests can pass in-memory ports.

uvicorn runs inside the caller's event loop (``WorkerServer``), on a socket bound here
(so ``port=0`` works and the real port is known before serving). Signals are handled
by ``run_worker`` rather than by uvicorn, which would re-raise SIGTERM after its own
shutdown and kill the process before the engine is shut down. On SIGTERM or SIGINT
the server stops accepting, finishes in-flight requests, drains the staging writer
(app lifespan), then the engine shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from vllm.utils.mistral import is_mistral_tokenizer

from pipeline.auth.credentials import Credentials
from pipeline.auth.transport import SERVER_KEEP_ALIVE_S, TlsFiles, check_bind
from pipeline.kafka.config import KafkaConfig
from pipeline.process.signals import STOP_SIGNALS
from pipeline.worker import DEFAULT_MAX_BODY_BYTES
from pipeline.worker.reasoning import AUTO, reasoning_parser_for, tool_parser_for
from pipeline.worker.retention import retaining
from pipeline.worker.server import create_app
from pipeline.worker.serving import ServingOptions, build_serving
from pipeline.worker.tokenizer_mode import AUTO as AUTO_TOKENIZER_MODE
from pipeline.worker.tokenizer_mode import resolve_tokenizer_mode
from stages.capture.cache import ChainCache
from stages.capture.chat import ChatRenderer, template_family
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.retain import DEFAULT_BUDGET_BYTES, RetainedRows
from stages.capture.vllm.client import CapturingEngineClient, LogprobPath, SpanPolicy
from stages.capture.vllm.engine import EngineSettings, VllmEngine
from stages.capture.vllm.mistral import MistralChatRenderer
from stages.capture.vllm.worker import VllmWorker
from stages.capture.writer import StagingWriter
from stages.ports import DataPlane, EventSink
from stages.recent import DEFAULT_REMEMBER

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"worker-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process is configured with, apart from its ports."""

    model_dir: Path
    worker_id: str = field(default_factory=default_worker_id)
    ack_policy: AckPolicy = AckPolicy.STAGED
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    weight_version: int = 0
    span_policy: SpanPolicy = SpanPolicy.RECORD
    logprob_path: LogprobPath = LogprobPath.SAMPLED
    """How captured calls get their sampled logprobs when their client asked for none."""
    prefix_wait_s: float = 5.0
    cache_bytes: int = 256 * 2**20
    writer_max_queue: int = 4096
    retain_bytes: int = DEFAULT_BUDGET_BYTES
    """Staged rows kept until finalized, to stage again into a restarted data plane."""
    remember: int = DEFAULT_REMEMBER
    """Finalized rollouts recognised after their rows went, so a late row is deleted."""
    graceful_timeout_s: float = 60.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None
    """Template text overriding the tokenizer's, for serving and for the splice alike."""
    template_family: str | None = None
    """The template's name in splice-failure logs and metrics (default: what the model
    records, or ``custom`` for a ``chat_template`` override)."""
    tokenizer_mode: str = AUTO_TOKENIZER_MODE
    """``auto`` or ``mistral`` (``pipeline.worker.tokenizer_mode``): how chat becomes tokens."""
    tool_parser: str | None = AUTO
    """``auto`` (``mistral`` under mistral_common, else the template family's parser,
    ``FAMILY_TOOL_PARSERS``, else ``hermes``), a vLLM parser, or None: tool calls left in the text."""
    reasoning_parser: str = AUTO
    """``auto`` (the template family's parser, ``FAMILY_REASONING_PARSERS``), ``none``, or a vLLM parser."""
    engine: EngineSettings | None = None
    credentials: Credentials = field(default_factory=Credentials)
    """The role secrets it checks (DESIGN §15); none: open, loopback only."""
    insecure_no_auth: bool = False
    tls: TlsFiles | None = None

    @property
    def family(self) -> str:
        """The template's family: as named, ``custom`` for an override, else the model's own."""
        if self.template_family is not None:
            return self.template_family
        return "custom" if self.chat_template is not None else template_family(self.model_dir)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.name

    def engine_settings(self) -> EngineSettings:
        if self.engine is not None:
            return self.engine
        mode = resolve_tokenizer_mode(self.model_dir, self.tokenizer_mode, chat_template=self.chat_template)
        return EngineSettings(model=str(self.model_dir), tokenizer_mode=mode)


def build_worker(
    config: WorkerConfig,
    engine: VllmEngine,
    data_plane: DataPlane,
    sink: EventSink,
    *,
    llm: Any = None,
    retained: RetainedRows | None = None,
) -> VllmWorker:
    """The capture core on the given ports, around an already started engine.

    ``llm`` is the engine client to capture on (default: the engine's own ``AsyncLLM``).
    """
    cache = ChainCache(config.cache_bytes)
    writer = StagingWriter(
        data_plane, sink, worker_id=config.worker_id, max_queue=config.writer_max_queue, retained=retained
    )
    core = CaptureCore(
        PrefixResolver(data_plane, cache, wait_s=config.prefix_wait_s),
        writer,
        cache,
        ack_policy=config.ack_policy,
    )
    client = CapturingEngineClient(
        engine.llm if llm is None else llm,
        weight_version=config.weight_version,
        span_policy=config.span_policy,
        logprob_path=config.logprob_path,
    )
    return VllmWorker(client, engine, chat_renderer(config, client), core)


def chat_renderer(config: WorkerConfig, client: CapturingEngineClient) -> ChatRenderer:
    """The history renderer for the splice: the one the engine's tokenizer renders with.

    vLLM loaded a mistral_common tokenizer (its mistral mode) or a Hugging Face one; the
    history goes through the same. A Hugging Face tokenizer without a chat template (and no
    ``chat_template``) renders no chat request, so the worker is refused here, naming why.
    """
    tokenizer = client.renderer.tokenizer
    if is_mistral_tokenizer(tokenizer):
        if config.chat_template is not None:
            raise ValueError(
                "chat-template: the engine renders this model with mistral_common, not a template"
            )
        return MistralChatRenderer.of_engine(tokenizer, config.model_dir, family=config.family)
    renderer = ChatRenderer.from_pretrained(
        config.model_dir, chat_template=config.chat_template, family=config.family
    )
    if renderer.template_text is None:
        raise ValueError(
            f"model: {config.model_dir} has no chat template and the engine serves it without mistral_common, "
            "so the worker cannot render chat requests nor capture them; pass --chat-template FILE"
        )
    return renderer


def build_app(worker: VllmWorker, config: WorkerConfig, *, manage_worker: bool = True) -> FastAPI:
    """vLLM's serving layers on the worker's capturing client, behind the worker's routes."""
    options = ServingOptions(
        model_name=config.model_name,
        model_path=str(config.model_dir),
        chat_template=config.chat_template,
        tool_parser=tool_parser_for(config.tool_parser, config.family, worker.renderer.tokenizer_mode),
        reasoning_parser=reasoning_parser_for(config.reasoning_parser, config.family),
    )
    return create_app(
        worker,
        build_serving(worker.client, options),
        worker_id=config.worker_id,
        manage_worker=manage_worker,
        max_body_bytes=config.max_body_bytes,
        credentials=config.credentials,
    )


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: the owner of the loop decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class WorkerServer:
    """uvicorn serving an app inside the current event loop; ``start``/``stop`` are awaitable."""

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        graceful_timeout_s: float = 60.0,
        tls: TlsFiles | None = None,
    ) -> None:
        self.host = host
        self.scheme = "http" if tls is None else "https"
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on",
            log_config=None,
            timeout_graceful_shutdown=max(1, round(graceful_timeout_s)),
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
            ssl_certfile=None if tls is None else str(tls.certfile),
            ssl_keyfile=None if tls is None else str(tls.keyfile),
        )
        self._server = _Server(self._config)
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("the server is not started")
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind, run the app's startup, and return once requests are accepted."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._config.port))
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(True)
        self._socket = sock
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name="uvicorn"
        )
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the HTTP server exited during startup")
            await asyncio.sleep(0.02)
        log.info("worker listening on %s", self.url)

    def request_stop(self) -> None:
        """Ask for a graceful stop (safe from a signal handler)."""
        self._server.should_exit = True

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests, run the app's shutdown."""
        self.request_stop()
        await self.wait()


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM/SIGINT call ``stop`` while the block runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def run_worker(
    config: WorkerConfig,
    *,
    data_plane: DataPlane,
    sink: EventSink,
    engine: VllmEngine | None = None,
    on_ready: Callable[[WorkerServer], None] | None = None,
    kafka: KafkaConfig | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or the server stops); then drain and shut the engine down.

    Without ``engine`` a vLLM engine is started from ``config`` (tens of seconds) and
    shut down on return; a given engine belongs to the caller. With ``kafka`` the worker
    keeps its staged rows until finalized (``pipeline.worker.retention``).
    """
    check_bind(config.host, config.credentials, insecure_no_auth=config.insecure_no_auth, what="worker")
    owned = engine is None
    active = VllmEngine.start(config.engine_settings()) if engine is None else engine
    try:
        retained = RetainedRows(config.retain_bytes, remember=config.remember) if kafka is not None else None
        worker = build_worker(config, active, data_plane, sink, retained=retained)
        server = WorkerServer(
            build_app(worker, config),
            host=config.host,
            port=config.port,
            graceful_timeout_s=config.graceful_timeout_s,
            tls=config.tls,
        )
        keeping = retaining(worker.core, data_plane, kafka) if kafka is not None else contextlib.nullcontext()
        async with keeping:
            with stop_on_signals(server.request_stop):
                await server.start()
                if on_ready is not None:
                    on_ready(server)
                await server.wait()
    finally:
        if owned:
            active.shutdown()
