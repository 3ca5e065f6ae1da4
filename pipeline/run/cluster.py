"""The services a run plays against: started here (``tokentrail run``) or attached to
(``tokentrail drive``), each stopped in reverse order when the run's stack unwinds.

Order of start: the model; the event log (embedded tansu broker or external Kafka) and
its topics; the data plane; the stage processes (they boot while the engine starts); the
vLLM engine, which blocks the event loop while it starts and so comes before any Kafka
or data-plane client on this loop; the run's producer and its followers
(``pipeline.run.outcomes``); the stages' readiness (or the stages in process); the
capture worker; with ``--agent sdk`` a gateway in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.auth.credentials import Credentials, Role
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.run.chat_http import HttpChatEndpoint
from pipeline.run.config import Attach, RunConfig
from pipeline.run.outcomes import Outcomes, follow_outcomes
from pipeline.run.report import RunProgress
from pipeline.run.services import (
    data_plane_settings,
    ensure_model,
    event_log,
    event_log_identity,
    run_groups,
    running_stages,
    serving_gateway,
    serving_worker,
    stage_children,
    start_engine,
)
from pipeline.run.shutdown import Shutdown
from pipeline.stagehost.processes import StageOptions
from pipeline.worker.tokenizer_mode import resolve_tokenizer_mode
from stages.ledger.stage import LedgerConfig
from stages.ports import DataPlane

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Services:
    """What the run's players and trainer reach: the log, the data plane, the worker or the
    gateway, and the run's outcomes."""

    kafka: KafkaConfig
    plane: DataPlane
    outcomes: Outcomes
    model_dir: Path
    """The served model's files (``tokentrail drive``: as the run would build it; maybe absent)."""
    served_model: str
    """The model's name as the gateway serves it."""
    worker_url: str | None
    """None: driving a cluster through its gateway only."""
    endpoint: HttpChatEndpoint | None
    """The built-in driver's client of the worker; None when the players go through a gateway."""
    gateway_url: str | None
    dataplane_addresses: str | None
    """The embedded data plane's address file, for other processes to attach to."""


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every part of the run is built with."""

    config: RunConfig
    run_id: str
    rollout_ids: list[str]
    credentials: Credentials
    progress: RunProgress
    shutdown: Shutdown


async def start_services(stack: contextlib.AsyncExitStack, run: RunContext) -> Services:
    """Every service in this process: broker, data plane, stage processes, engine, stages, worker."""
    config, progress, shutdown = run.config, run.progress, run.shutdown
    progress.enter("preparing the model")
    model_dir = await asyncio.to_thread(ensure_model, config)
    shutdown.check()

    progress.enter("starting the event log")
    kafka, broker = await stack.enter_async_context(event_log(config, shutdown.fail))
    await ensure_topics(kafka)
    shutdown.check()

    progress.enter("starting the data plane")
    from pipeline.dataplane import DataPlaneConfig, open_data_plane

    plane_config = DataPlaneConfig(
        mode=config.dataplane_mode, data_dir=config.data_dir, ray_address=config.ray_address
    )
    plane = await stack.enter_async_context(open_data_plane(plane_config))
    addresses = str(plane_config.addresses_path) if config.dataplane_mode == "embedded" else None
    shutdown.check()

    ledger = LedgerConfig(seal_grace_s=config.seal_grace_s, max_open_s=config.max_open_s)
    options = StageOptions(ledger, run_groups(broker, config.fetch_wait_ms), bounds=config.bounds)
    children = None
    if config.stages == "processes":
        # Started before the engine, whose start blocks this loop for tens of seconds:
        # the children boot and join their groups meanwhile, in processes of their own.
        progress.enter("starting the stage processes")
        reach = data_plane_settings(config, plane_config.addresses_path)
        children = await stack.enter_async_context(
            stage_children(
                kafka, replace(options, data_plane=reach), on_failure=shutdown.fail, stop=shutdown.event
            )
        )

    progress.enter("starting the vLLM engine")
    log.info("starting the vLLM engine on %s", model_dir)
    tokenizer_mode = resolve_tokenizer_mode(model_dir, config.tokenizer_mode)
    engine = start_engine(model_dir, config.seed, tokenizer_mode)
    stack.callback(engine.shutdown)
    shutdown.check()

    # Followers and in-process stages are consumer-group members on this loop: they
    # start once the engine no longer blocks it, so their sessions never lapse.
    outcomes = await _follow(stack, run, kafka, plane, event_log_identity(kafka, broker))
    progress.enter("starting the stages")
    if children is None:
        await stack.enter_async_context(
            running_stages(kafka, outcomes.sink, plane, options, on_failure=shutdown.fail)
        )
    else:
        await children.ready()
    shutdown.check()  # a child that exited, or a signal, while they were getting ready

    progress.enter("starting the worker")
    credentials = run.credentials
    server = await stack.enter_async_context(
        serving_worker(
            model_dir, engine, plane, outcomes.sink, credentials, config.reasoning_parser, tokenizer_mode
        )
    )
    endpoint = await stack.enter_async_context(
        HttpChatEndpoint(server.url, headers=credentials.authorization(Role.SERVICE))
    )
    gateway_url = None
    if config.agent == "sdk":
        progress.enter("starting the gateway")
        gateway_url = await stack.enter_async_context(
            serving_gateway(server.url, outcomes.sink, outcomes.seals, credentials)
        )
    return Services(
        kafka=kafka,
        plane=plane,
        outcomes=outcomes,
        model_dir=model_dir,
        served_model=model_dir.name,
        worker_url=server.url,
        endpoint=endpoint,
        gateway_url=gateway_url,
        dataplane_addresses=addresses,
    )


async def attach_services(stack: contextlib.AsyncExitStack, run: RunContext, attach: Attach) -> Services:
    """``tokentrail drive``: the cluster's broker, data plane, stages and workers are running."""
    from pipeline.dataplane import attach_data_plane

    config = run.config
    run.progress.enter("attaching")
    kafka = config.kafka
    await ensure_topics(kafka)
    plane = await stack.enter_async_context(attach_data_plane(attach.dataplane_addresses))
    outcomes = await _follow(stack, run, kafka, plane, event_log_identity(kafka, None))
    endpoint = None
    if attach.worker_url is not None:
        endpoint = await stack.enter_async_context(
            HttpChatEndpoint(attach.worker_url, headers=run.credentials.authorization(Role.SERVICE))
        )
    return Services(
        kafka=kafka,
        plane=plane,
        outcomes=outcomes,
        model_dir=config.resolved_model_dir,
        served_model=attach.model or "",
        worker_url=attach.worker_url,
        endpoint=endpoint,
        gateway_url=attach.gateway_url,
        dataplane_addresses=None if attach.dataplane_addresses is None else str(attach.dataplane_addresses),
    )


async def _follow(
    stack: contextlib.AsyncExitStack, run: RunContext, kafka: KafkaConfig, plane: DataPlane, identity: str
) -> Outcomes:
    return await follow_outcomes(
        stack,
        kafka=kafka,
        plane=plane,
        log_identity=identity,
        data_dir=run.config.data_dir,
        run_id=run.run_id,
        rollout_ids=run.rollout_ids,
        progress=run.progress,
        shutdown=run.shutdown,
    )
