"""One stage process (``tokentrail stage NAME``): its metrics endpoint, its data plane,
the finalizer's sample copies, the stage itself, served through broker outages."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from pipeline.dataplane.config import OWNER_WAIT_S, RESTAGE_GRACE_S
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.kafka.producer import KafkaEventSink
from pipeline.process.signals import STOP_SIGNALS
from pipeline.stagehost.metrics import Health, StageMetrics
from pipeline.stagehost.outages import serve_through_outages
from pipeline.stagehost.ready import ReadyNotice
from pipeline.stagehost.runner import serve_stage
from pipeline.stagehost.server import MetricsServer
from pipeline.stagehost.settings import StageHostSettings
from stages.finalize.retain import RetainedSamples, RetentionConfig
from stages.specs import FINALIZER, STAGES


async def host_stage(settings: StageHostSettings, kafka: KafkaConfig) -> None:
    """Serve the stage until SIGTERM or SIGINT (finish the batch, commit, leave the group).
    A setting the broker or the host refuses is a ``ConfigError``."""
    try:  # before the topics are created with it
        kafka.retention.check(settings.max_open_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    metrics = StageMetrics(settings.name, health=Health(stall_after_s=settings.stall_after))
    server = _metrics_server(settings, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    ready = ReadyNotice(settings.ready_fd)

    async def serve() -> None:
        await ensure_topics(kafka)
        await _serve_stage(settings, kafka, metrics, stop, ready)

    try:
        await serve_through_outages(serve, settings.name, metrics.health, stop)
    finally:
        ready.close()
        if server is not None:
            server.stop()


def _metrics_server(settings: StageHostSettings, metrics: StageMetrics) -> MetricsServer | None:
    """The metrics endpoint, started before anything else so probes answer during startup."""
    if settings.metrics_port == 0:
        return None
    server = MetricsServer(metrics, host=settings.metrics_host, port=settings.metrics_port)
    try:
        server.start()
    except OSError as exc:
        raise ConfigError(f"--metrics-port {settings.metrics_port}: cannot serve metrics: {exc}") from None
    return server


async def _retention(
    settings: StageHostSettings, kafka: KafkaConfig, plane: Any, stack: contextlib.AsyncExitStack
) -> RetainedSamples | None:
    """The finalizer's copies of unacknowledged samples (DESIGN §7.4), put back into the data
    plane whenever it re-attaches to a restarted owner."""
    from pipeline.dataplane.reattach import ReattachingDataPlane
    from pipeline.kafka.lag import LagReader
    from pipeline.kafka.owners import KafkaSampleOwners
    from pipeline.samples.spool import DirectorySpool

    if settings.name != FINALIZER.name or settings.retain_samples_bytes == 0:
        return None
    reader = await stack.enter_async_context(LagReader(kafka))
    owners = KafkaSampleOwners(reader, settings.owners)
    spool = DirectorySpool(settings.spool_dir)
    retained = RetainedSamples(owners, RetentionConfig(budget_bytes=settings.retain_samples_bytes), spool)
    if isinstance(plane, ReattachingDataPlane):
        plane.on_reattach(retained.restore)
    await retained.reclaim(plane)
    return retained


async def _serve_stage(
    settings: StageHostSettings,
    kafka: KafkaConfig,
    metrics: StageMetrics,
    stop: asyncio.Event,
    ready: ReadyNotice,
) -> None:
    spec = STAGES[settings.name]
    stage_settings = settings.stage_settings
    async with contextlib.AsyncExitStack() as stack:
        sink = metrics.sink(await stack.enter_async_context(KafkaEventSink(kafka)))
        plane = None
        if spec.uses_data_plane:
            from pipeline.dataplane import DataPlaneConfig, open_data_plane

            addresses = settings.dataplane_addresses
            plane_config = DataPlaneConfig.from_env(
                mode=settings.dataplane_mode,
                data_dir=settings.data_dir,
                ray_address=settings.ray_address,
                restage_grace_s=RESTAGE_GRACE_S,  # missing rows may be on their way back
                owner_wait_s=OWNER_WAIT_S,  # outlive a dead owner: the sample copies live here
                **({"addresses_file": addresses} if addresses else {}),
            )
            opened = await stack.enter_async_context(open_data_plane(plane_config))
            plane = metrics.data_plane(opened)
            stage_settings = replace(
                stage_settings, retained=await _retention(settings, kafka, opened, stack)
            )
        started = asyncio.Event()
        announce = asyncio.create_task(ready.announce_when(started), name="ready-notice")
        stack.callback(announce.cancel)
        await serve_stage(
            spec.build(sink, plane, stage_settings),
            spec,
            kafka,
            sink,
            stop=stop,
            group=settings.group,
            tuning=settings.tuning,
            instance_id=settings.instance_id,
            metrics=metrics,
            lag_interval_s=settings.lag_interval,
            started=started,
        )
