"""``tokentrail stage ledger|finalizer``: run one stage as a long-lived consumer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.dataplane.config import OWNER_WAIT_S, RESTAGE_GRACE_S, add_dataplane_addresses_argument
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import ConfigError, KafkaConfig, add_kafka_arguments, config_from_args
from pipeline.kafka.consumer import DEFAULT_TUNING
from pipeline.kafka.embedded.tansu import TANSU
from pipeline.kafka.errors import BROKER_UNREACHABLE
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.profile import KAFKA
from pipeline.kafka.retention import add_retention_argument
from pipeline.process.heap import collect_per_batch
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from pipeline.stagehost.lag import DEFAULT_INTERVAL_S
from pipeline.stagehost.metrics import Health, StageMetrics
from pipeline.stagehost.runner import serve_stage
from pipeline.stagehost.server import MetricsServer
from stages.finalize.janitor import JanitorConfig
from stages.finalize.retain import DEFAULT_BUDGET_BYTES, TRAINER_GROUP, RetainedSamples, RetentionConfig
from stages.finalize.verify import MixedVersionPolicy
from stages.ledger.stage import LedgerConfig
from stages.specs import FINALIZER, STAGES, StageSettings, staging_ttl

log = logging.getLogger(__name__)

RETAIN_DIR_NAME = "retained-samples"
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 10.0

EXAMPLES = """\
examples:
  tokentrail stage ledger --bootstrap 127.0.0.1:9092
  tokentrail stage ledger --bootstrap kafka:9092 --seal-grace 30 --group ledger-prod
  tokentrail stage finalizer --bootstrap 127.0.0.1:9092 --data-dir .tokentrail
  tokentrail stage finalizer --bootstrap kafka:9092 --dataplane-mode ray --ray-address auto --mixed-versions reject
  tokentrail stage ledger --bootstrap kafka:9092 --metrics-port 9464 --metrics-host 0.0.0.0
  tokentrail stage ledger --bootstrap kafka:9092 --retention admission=5d --retention staged=5d

With --metrics-port the stage serves /metrics (Prometheus), /healthz (503 once the
consumer loop stalls for --stall-after seconds) and /readyz (200 once the group
assigned this member its partitions). With --ready-fd the stage writes one line to
that inherited file descriptor once its group first assigned it, and closes it: how
`tokentrail run` knows that its stage processes are serving.

The stage creates missing topics with --retention (DESIGN §7.6; an existing topic's
other retention is logged, not altered) and refuses one shorter than --max-open plus 1h.
Run several instances with the same --group to split partitions between them.
SIGTERM/SIGINT finish the in-flight batch, commit, and leave the group. A broker that
goes away is waited for: the stage reconnects (backing off up to 10 s), no restart needed.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "stage",
        help="run the ledger or finalizer stage as a long-lived consumer",
        description="Run one tokentrail stage as a member of its consumer group.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ledger, settings, tuning = LedgerConfig(), StageSettings(), DEFAULT_TUNING
    parser.add_argument("name", choices=list(STAGES), help="which stage")
    add_kafka_arguments(parser, bootstrap_required=True)
    parser.add_argument("--group", help="consumer group (default: tokentrail-<stage>)")
    parser.add_argument(
        "--seal-grace",
        type=float,
        default=ledger.seal_grace_s,
        help="ledger: seconds a seal waits (default %(default)s)",
    )
    parser.add_argument(
        "--max-open",
        type=float,
        default=ledger.max_open_s,
        help="ledger: seconds before an unsealed rollout closes (default %(default)s)",
    )
    add_retention_argument(parser)
    parser.add_argument(
        "--staging-ttl",
        type=float,
        help=(
            "finalizer: seconds after which a staging row nobody finished is deleted "
            "(default: twice --max-open plus --seal-grace, so no rollout that can still close loses a row)"
        ),
    )
    parser.add_argument(
        "--staging-sweep",
        type=float,
        default=JanitorConfig().sweep_every_s,
        help="finalizer: seconds between sweeps of the staging partition (default %(default)s)",
    )
    parser.add_argument(
        "--remember",
        type=int,
        default=settings.remember,
        help=(
            "rollouts remembered as answered (read back from the output topic's tail when partitions are assigned), "
            "so duplicated input gets no second outcome (default %(default)s)"
        ),
    )
    parser.add_argument(
        "--closed-budget-mib",
        type=_non_negative_float,
        default=settings.closed_budget_bytes / 2**20,
        help=(
            "ledger: memory for the call ids of recently closed rollouts (~330 bytes a 16-call rollout), by which "
            "a late event is told from a duplicate; over it the oldest are forgotten (default %(default)g)"
        ),
    )
    parser.add_argument(
        "--mixed-versions",
        choices=[p.value for p in MixedVersionPolicy],
        default=settings.mixed_versions.value,
        help="finalizer: policy for samples mixing weight versions (default allow)",
    )
    parser.add_argument(
        "--all-or-nothing",
        action="store_true",
        default=settings.all_or_nothing,
        help=(
            "finalizer: under a multi-sample policy, one rejected chain rejects every sample of its rollout, "
            "for rollouts whose seal does not say (default: each chain stands alone)"
        ),
    )
    parser.add_argument(
        "--sample-owner",
        action="append",
        metavar="GROUP",
        help=(
            "finalizer: a consumer group that owns the samples; a copy of each sample is kept until every owner "
            "committed past its outcome, and put back into a restarted data plane (repeatable; default "
            f"{TRAINER_GROUP})"
        ),
    )
    parser.add_argument(
        "--retain-samples-bytes",
        type=_non_negative_int,
        default=DEFAULT_BUDGET_BYTES,
        help=(
            "finalizer: memory for copies of samples their owners have not acknowledged; over it the oldest are "
            "let go, counted (default %(default)s; 0: keep none)"
        ),
    )
    parser.add_argument(
        "--retain-dir",
        type=Path,
        help=(
            "finalizer: where the copies of unacknowledged samples are spooled, so that a restarted finalizer "
            "still has them (default: DATA_DIR/retained-samples)"
        ),
    )
    parser.add_argument(
        "--dataplane-mode",
        choices=["attach", "ray", "embedded"],
        default="attach",
        help=(
            "attach: to a local data plane through its address file; ray: to TransferQueue on a Ray "
            "cluster; embedded: own one in this process (tests) (default: %(default)s)"
        ),
    )
    add_dataplane_addresses_argument(parser)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(".tokentrail"),
        help="where dataplane.json lives (default: %(default)s)",
    )
    parser.add_argument("--ray-address", help="Ray cluster address for --dataplane-mode ray")
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=tuning.session_timeout_ms,
        help="consumer group session timeout (default %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-ms",
        type=int,
        default=tuning.heartbeat_interval_ms,
        help="consumer group heartbeat interval (default %(default)s)",
    )
    parser.add_argument(
        "--fetch-wait-ms",
        type=int,
        default=tuning.fetch_wait_ms,
        help="how long the broker may hold an empty fetch: latency per hop vs idle CPU "
        f"(default: the broker kind's: {KAFKA.fetch_wait_ms} on Kafka, {TANSU.fetch_wait_ms} on the embedded broker)",
    )
    parser.add_argument(
        "--instance-id",
        help="a name this member keeps across restarts (one per member of the group): on Kafka it "
        "joins as a static member, so a restart within the session timeout causes no rebalance",
    )
    parser.add_argument(
        "--merge-margin-ms",
        type=int,
        default=tuning.idle_margin_ms,
        help=(
            "ledger: how long after its timestamp a record may reach the log (the log-time merge's margin); "
            "each event waits about this long while a partition is idle (default %(default)s)"
        ),
    )
    parser.add_argument(
        "--ready-fd",
        type=int,
        metavar="FD",
        help="write one line to this inherited file descriptor once the group first assigned this member",
    )
    add_metrics_arguments(parser)
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        help="serve /metrics, /healthz and /readyz on this port (default 0: off)",
    )
    group.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics server binds (default %(default)s; 0.0.0.0 in a container)",
    )
    group.add_argument(
        "--lag-interval",
        type=_positive,
        default=DEFAULT_INTERVAL_S,
        help="seconds between consumer-lag readings for the lag gauge (default %(default)s)",
    )
    group.add_argument(
        "--stall-after",
        type=_positive,
        default=60.0,
        help="seconds without a consumer-loop tick before /healthz fails (default %(default)s)",
    )


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0 turns metrics off)")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _metrics_server(args: argparse.Namespace, metrics: StageMetrics) -> MetricsServer | None:
    """The metrics endpoint, started before anything else so probes answer during startup."""
    if args.metrics_port == 0:
        return None
    server = MetricsServer(metrics, host=args.metrics_host, port=args.metrics_port)
    try:
        server.start()
    except OSError as exc:
        raise ConfigError(f"--metrics-port {args.metrics_port}: cannot serve metrics: {exc}") from None
    return server


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    collect_per_batch()
    try:
        asyncio.run(_serve(args))
    except ConfigError as exc:
        print(f"tokentrail stage: {exc}", file=sys.stderr)
        return 2
    except Exception:
        # Nothing was committed past the failed batch, so a restart replays it. Exit at
        # once: TransferQueue's client threads are not daemons and would keep a dead
        # stage's process alive, hiding the failure from whatever restarts it.
        log.exception("stage %s failed; exiting so that it is restarted", args.name)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


async def _serve(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    try:  # before the topics are created with it
        config.retention.check(args.max_open)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    metrics = StageMetrics(args.name, health=Health(stall_after_s=args.stall_after))
    server = _metrics_server(args, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = ReadyNotice(args.ready_fd)
    try:
        await _serve_through_outages(args, config, metrics, stop, ready)
    finally:
        ready.close()
        if server is not None:
            server.stop()


class ReadyNotice:
    """``--ready-fd``: one line to the parent once the group first assigned this member.

    Only the first assignment is announced: a parent waits for it once, and a stage
    started again after an outage is the same member to it."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_inheritable(fd, False)  # for this process only, not for anything it starts

    async def announce_when(self, started: asyncio.Event) -> None:
        await started.wait()
        if self.fd is not None:
            with contextlib.suppress(OSError):  # the parent stopped listening: nothing to tell
                os.write(self.fd, b"ready\n")
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


async def _serve_through_outages(
    args: argparse.Namespace,
    config: KafkaConfig,
    metrics: StageMetrics,
    stop: asyncio.Event,
    ready: ReadyNotice,
) -> None:
    """Serve the stage; when the broker cannot be reached, start it again in this process
    once the broker answers (backing off), as a restart would: from the committed offsets,
    with state rebuilt by replay. Short outages never get here: the clients reconnect."""
    backoff = RECONNECT_MIN_S
    while not stop.is_set():
        started = asyncio.get_running_loop().time()
        try:
            await ensure_topics(config)
            await _serve_stage(args, config, metrics, stop, ready)
            return
        except BROKER_UNREACHABLE as exc:
            metrics.health.set_ready(False)
            if asyncio.get_running_loop().time() - started > RECONNECT_MAX_S:
                backoff = RECONNECT_MIN_S  # it had been serving: a new outage
            log.warning("stage %s: broker unreachable (%r); starting again in %.1fs", args.name, exc, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)


async def _retention(
    args: argparse.Namespace, config: KafkaConfig, plane: Any, stack: contextlib.AsyncExitStack
) -> RetainedSamples | None:
    """The finalizer's copies of unacknowledged samples (DESIGN §7.4), put back into the data
    plane whenever it re-attaches to a restarted owner."""
    from pipeline.dataplane.reattach import ReattachingDataPlane
    from pipeline.kafka.lag import LagReader
    from pipeline.kafka.owners import KafkaSampleOwners
    from pipeline.samples.spool import DirectorySpool

    if args.name != FINALIZER.name or args.retain_samples_bytes == 0:
        return None
    reader = await stack.enter_async_context(LagReader(config))
    owners = KafkaSampleOwners(reader, args.sample_owner or [TRAINER_GROUP])
    spool = DirectorySpool(args.retain_dir or args.data_dir / RETAIN_DIR_NAME)
    retained = RetainedSamples(owners, RetentionConfig(budget_bytes=args.retain_samples_bytes), spool)
    if isinstance(plane, ReattachingDataPlane):
        plane.on_reattach(retained.restore)
    await retained.reclaim(plane)
    return retained


async def _serve_stage(
    args: argparse.Namespace,
    config: KafkaConfig,
    metrics: StageMetrics,
    stop: asyncio.Event,
    ready: ReadyNotice,
) -> None:
    spec = STAGES[args.name]
    tuning = replace(
        DEFAULT_TUNING,
        session_timeout_ms=args.session_timeout_ms,
        heartbeat_interval_ms=args.heartbeat_ms,
        fetch_wait_ms=args.fetch_wait_ms,
        idle_margin_ms=args.merge_margin_ms,
    )
    ledger = LedgerConfig(seal_grace_s=args.seal_grace, max_open_s=args.max_open)
    settings = StageSettings(
        ledger=ledger,
        mixed_versions=MixedVersionPolicy(args.mixed_versions),
        all_or_nothing=args.all_or_nothing,
        remember=args.remember,
        closed_budget_bytes=round(args.closed_budget_mib * 2**20),
        janitor=JanitorConfig(
            ttl_s=args.staging_ttl or staging_ttl(ledger), sweep_every_s=args.staging_sweep
        ),
    )
    async with contextlib.AsyncExitStack() as stack:
        sink = metrics.sink(await stack.enter_async_context(KafkaEventSink(config)))
        plane = None
        if spec.uses_data_plane:
            from pipeline.dataplane import DataPlaneConfig, open_data_plane

            plane_config = DataPlaneConfig.from_env(
                mode=args.dataplane_mode,
                data_dir=args.data_dir,
                ray_address=args.ray_address,
                restage_grace_s=RESTAGE_GRACE_S,  # missing rows may be on their way back
                owner_wait_s=OWNER_WAIT_S,  # outlive a dead owner: the sample copies live here
                **({"addresses_file": args.dataplane_addresses} if args.dataplane_addresses else {}),
            )
            opened = await stack.enter_async_context(open_data_plane(plane_config))
            plane = metrics.data_plane(opened)
            settings = replace(settings, retained=await _retention(args, config, opened, stack))
        started = asyncio.Event()
        announce = asyncio.create_task(ready.announce_when(started), name="ready-notice")
        stack.callback(announce.cancel)
        await serve_stage(
            spec.build(sink, plane, settings),
            spec,
            config,
            sink,
            stop=stop,
            group=args.group,
            tuning=tuning,
            instance_id=args.instance_id,
            metrics=metrics,
            lag_interval_s=args.lag_interval,
            started=started,
        )
