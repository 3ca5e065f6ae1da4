"""The long-lived parts of a run, each as a context that starts it and stops it cleanly.

``pipeline.run.main`` stacks these in dependency order (an ``AsyncExitStack``), so they stop
in reverse: the worker drains before the stages commit and stop, the stages before the
data plane, and the broker last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.auth.credentials import Credentials
from pipeline.gateway.main import GatewayConfig, gateway
from pipeline.kafka.config import KafkaConfig, kafka_environment
from pipeline.kafka.consumer import ConsumerTuning
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.producer import KafkaEventSink
from pipeline.run.config import RunConfig
from pipeline.stagehost.processes import (
    StageOptions,
    StartedStages,
    stage_command,
    stage_processes,
)
from pipeline.stagehost.runner import serve_stage
from pipeline.stagehost.settings import RETAIN_DIR_NAME
from pipeline.worker.main import WorkerConfig, WorkerServer, build_app, build_worker
from stages.capture.vllm.engine import EngineSettings, VllmEngine
from stages.client import RolloutClient
from stages.ports import DataPlane
from stages.specs import STAGES

log = logging.getLogger(__name__)

# One process hosts the engine's frontend (and, with --stages inline, both stages): a group
# session of 3 s tolerates short event-loop stalls, and tansu's join pause (half of it)
# stays short. Stage processes get the same timings.
RUN_GROUPS = ConsumerTuning(session_timeout_ms=3_000, heartbeat_interval_ms=500)


def run_groups(broker: EmbeddedBroker | None, fetch_wait_ms: int | None) -> ConsumerTuning:
    """The run's group timings: the merge margin is as short as the log allows (DESIGN §7.2)."""
    tuning = replace(RUN_GROUPS, fetch_wait_ms=fetch_wait_ms)
    return tuning if broker is None else replace(tuning, idle_margin_ms=broker.merge_margin_ms)


STAGE_STOP_TIMEOUT_S = 30.0
LOOPBACK = "127.0.0.1"


class RunSetupError(RuntimeError):
    """A run cannot start as configured (a missing model, a busy data directory, ...)."""


def ensure_model(config: RunConfig) -> Path:
    """The model to serve: ``--model`` as given, else the tiny model (built once, offline)."""
    if config.model_dir is not None:
        if not (config.model_dir / "config.json").is_file():
            raise RunSetupError(f"{config.model_dir} is not a model directory (no config.json)")
        return config.model_dir.resolve()
    from pipeline.models.tiny import make_tiny_model

    return make_tiny_model(config.resolved_model_dir, seed=0).resolve()


@contextlib.asynccontextmanager
async def event_log(
    config: RunConfig, on_failure: Callable[[str], None]
) -> AsyncIterator[tuple[KafkaConfig, EmbeddedBroker | None]]:
    """The Kafka config to use: an external cluster as given, or an embedded tansu broker
    in the data directory (durable by default), stopped on exit. ``on_failure`` is called
    on the event loop if the broker dies while running."""
    if not config.embedded_broker:
        yield config.kafka, None
        return
    loop = asyncio.get_running_loop()
    broker = EmbeddedBroker(storage=config.broker_storage, data_dir=config.data_dir)
    await asyncio.to_thread(broker.start)
    try:

        def failed(exc: Exception) -> None:  # from the broker's watcher thread
            loop.call_soon_threadsafe(on_failure, f"broker: {exc}")

        broker.on_failure(failed)
        log.info("embedded broker (%s) at %s", config.broker_storage, broker.bootstrap)
        yield broker.attach(config.kafka), broker
    finally:
        await asyncio.to_thread(broker.stop)
        log.info("embedded broker stopped")


def event_log_identity(kafka: KafkaConfig, broker: EmbeddedBroker | None) -> str:
    """Which log this is: a durable store keeps its cluster id across runs, a memory
    broker's log is gone with it, and an external cluster is named by its bootstrap."""
    if broker is None:
        return f"kafka:{kafka.bootstrap_servers}"
    return f"{broker.storage}:{broker.cluster_id}"


def start_engine(model_dir: Path, seed: int, tokenizer_mode: str) -> VllmEngine:
    """The vLLM engine (blocks the loop for tens of seconds; start it before any client)."""
    return VllmEngine.start(EngineSettings(model=str(model_dir), seed=seed, tokenizer_mode=tokenizer_mode))


@contextlib.asynccontextmanager
async def running_stages(
    kafka: KafkaConfig,
    sink: KafkaEventSink,
    data_plane: DataPlane,
    options: StageOptions,
    *,
    on_failure: Callable[[str], None],
) -> AsyncIterator[dict[str, asyncio.Task[object]]]:
    """Every stage as a consumer-group member; on exit they finish their batch, commit
    and leave their groups. A stage that stops on its own calls ``on_failure``."""
    stop = asyncio.Event()
    settings, tuning = options.in_process, options.tuning
    tasks: dict[str, asyncio.Task[object]] = {
        name: asyncio.create_task(
            serve_stage(spec.build(sink, data_plane, settings), spec, kafka, sink, stop=stop, tuning=tuning),
            name=f"stage-{name}",
        )
        for name, spec in STAGES.items()
    }

    def watch(name: str) -> Callable[[asyncio.Task[object]], None]:
        def done(task: asyncio.Task[object]) -> None:
            if stop.is_set() or task.cancelled():
                return
            exc = task.exception()
            on_failure(f"stage {name} stopped: {exc!r}" if exc is not None else f"stage {name} stopped")

        return done

    for name, task in tasks.items():
        task.add_done_callback(watch(name))
    try:
        yield tasks
    finally:
        stop.set()
        _, pending = await asyncio.wait(tasks.values(), timeout=STAGE_STOP_TIMEOUT_S)
        for task in pending:
            log.warning(
                "stage task %s did not stop in %.0fs; cancelling", task.get_name(), STAGE_STOP_TIMEOUT_S
            )
            task.cancel()
        for task in tasks.values():
            with contextlib.suppress(BaseException):
                await task
        log.info("stages stopped and committed")


@contextlib.asynccontextmanager
async def stage_children(
    kafka: KafkaConfig,
    options: StageOptions,
    *,
    on_failure: Callable[[str], None],
    stop: asyncio.Event,
) -> AsyncIterator[StartedStages]:
    """``--stages processes``: every stage as a ``tokentrail stage`` child with the settings
    ``running_stages`` gives it in process, started but not waited for (``ready()`` waits
    until each child's group assigned it). A child that exits on its own calls
    ``on_failure``; on exit each gets SIGTERM (finish the batch, commit, leave the group),
    SIGKILL after the same timeout as an in-process stage."""
    commands = {name: stage_command(name, kafka, options) for name in STAGES}
    async with stage_processes(
        commands,
        on_failure=on_failure,
        stop=stop,
        stop_timeout_s=STAGE_STOP_TIMEOUT_S,
        env=kafka_environment(kafka),
    ) as started:
        yield started


def data_plane_settings(config: RunConfig, addresses_file: Path) -> dict[str, Any]:
    """How a stage process reaches the run's data plane (``StageHostSettings`` fields): the
    embedded one through the address file it published, TransferQueue on Ray as the run does."""
    if config.dataplane_mode == "embedded":
        # The run owns it: copies of samples would die with it (DESIGN §7.4), so none are kept.
        return {"dataplane_mode": "attach", "dataplane_addresses": addresses_file, "retain_samples_bytes": 0}
    return {
        "dataplane_mode": "ray",
        "ray_address": config.ray_address,
        "retain_dir": config.data_dir / RETAIN_DIR_NAME,
    }


@contextlib.asynccontextmanager
async def serving_gateway(
    worker_url: str, sink: KafkaEventSink, client: RolloutClient, credentials: Credentials
) -> AsyncIterator[str]:
    """A gateway in front of the run's worker on a free loopback port; yields its URL.

    ``client`` publishes its admissions and seals (the run's, so seals are journaled).
    """
    config = GatewayConfig(workers=(worker_url,), host=LOOPBACK, port=0, credentials=credentials)
    async with gateway(config, sink, client=client) as built:
        server = WorkerServer(built.app, host=LOOPBACK, port=0, graceful_timeout_s=30.0)
        await server.start()
        try:
            yield server.url
        finally:
            await server.stop()


@contextlib.asynccontextmanager
async def serving_worker(
    model_dir: Path,
    engine: VllmEngine,
    data_plane: DataPlane,
    sink: KafkaEventSink,
    credentials: Credentials,
    reasoning_parser: str,
    tokenizer_mode: str,
) -> AsyncIterator[WorkerServer]:
    """The capture worker on a free loopback port; on exit it finishes in-flight requests
    and drains its staging writer (the engine itself belongs to the caller)."""
    config = WorkerConfig(
        model_dir=model_dir,
        host=LOOPBACK,
        port=0,
        graceful_timeout_s=30.0,
        credentials=credentials,
        reasoning_parser=reasoning_parser,
        tokenizer_mode=tokenizer_mode,
    )
    worker = build_worker(config, engine, data_plane, sink)
    server = WorkerServer(build_app(worker, config), host=LOOPBACK, port=0, graceful_timeout_s=30.0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        log.info("worker drained")
