"""``tokentrail stage ledger|finalizer``: run one stage as a long-lived consumer."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pipeline.kafka.config import ConfigError, KafkaConfig, add_kafka_arguments, config_from_args
from pipeline.kafka.log import KafkaEventSink, ensure_topics
from pipeline.lag_gauge import DEFAULT_INTERVAL_S
from pipeline.logs import configure_logging
from pipeline.metrics import Health, StageMetrics
from pipeline.metrics_server import MetricsServer
from pipeline.stage_runner import (
    FINALIZER_GROUP,
    LEDGER_GROUP,
    ConsumerTuning,
    finalizer_topics,
    ledger_topics,
    serve_stage,
)
from stages.finalize.stage import FinalizerStage
from stages.finalize.verify import MixedVersionPolicy
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.recent import DEFAULT_REMEMBER

log = logging.getLogger(__name__)

EXAMPLES = """\
examples:
  tokentrail stage ledger --bootstrap 127.0.0.1:9092
  tokentrail stage ledger --bootstrap kafka:9092 --seal-grace 30 --group ledger-prod
  tokentrail stage finalizer --bootstrap 127.0.0.1:9092 --data-dir .tokentrail
  tokentrail stage finalizer --bootstrap kafka:9092 --dataplane-mode ray --ray-address auto --mixed-versions reject
  tokentrail stage ledger --bootstrap kafka:9092 --metrics-port 9464 --metrics-host 0.0.0.0

With --metrics-port the stage serves /metrics (Prometheus), /healthz (503 once the
consumer loop stalls for --stall-after seconds) and /readyz (200 once the group
assigned this member its partitions).

Run several instances with the same --group to split partitions between them.
SIGTERM/SIGINT finish the in-flight batch, commit, and leave the group.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "stage",
        help="run the ledger or finalizer stage as a long-lived consumer",
        description="Run one tokentrail stage as a member of its consumer group.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=["ledger", "finalizer"], help="which stage")
    add_kafka_arguments(parser, bootstrap_required=True)
    parser.add_argument("--group", help="consumer group (default: tokentrail-<stage>)")
    parser.add_argument(
        "--seal-grace", type=float, default=10.0, help="ledger: seconds a seal waits (default 10)"
    )
    parser.add_argument(
        "--max-open", type=float, default=3600.0, help="ledger: seconds before an unsealed rollout closes"
    )
    parser.add_argument(
        "--remember",
        type=int,
        default=DEFAULT_REMEMBER,
        help=(
            "rollouts remembered as answered (read back from the output topic's tail when partitions are assigned), "
            "so duplicated input gets no second outcome (default %(default)s)"
        ),
    )
    parser.add_argument(
        "--mixed-versions",
        choices=[p.value for p in MixedVersionPolicy],
        default="allow",
        help="finalizer: policy for samples mixing weight versions (default allow)",
    )
    parser.add_argument("--dataplane-mode", choices=["attach", "ray", "embedded"], default="attach")
    parser.add_argument(
        "--data-dir", type=Path, default=Path(".tokentrail"), help="where dataplane.json lives"
    )
    parser.add_argument("--ray-address", help="Ray cluster address for --dataplane-mode ray")
    parser.add_argument(
        "--session-timeout-ms", type=int, default=10_000, help="consumer group session timeout"
    )
    parser.add_argument("--heartbeat-ms", type=int, default=3_000, help="consumer group heartbeat interval")
    add_metrics_arguments(parser)
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
    configure_logging()
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
    metrics = StageMetrics(args.name, health=Health(stall_after_s=args.stall_after))
    server = _metrics_server(args, metrics)
    try:
        await ensure_topics(config)
        await _serve_stage(args, config, metrics)
    finally:
        if server is not None:
            server.stop()


async def _serve_stage(args: argparse.Namespace, config: KafkaConfig, metrics: StageMetrics) -> None:
    tuning = ConsumerTuning(
        session_timeout_ms=args.session_timeout_ms, heartbeat_interval_ms=args.heartbeat_ms
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with KafkaEventSink(config) as kafka_sink:
        sink = metrics.sink(kafka_sink)
        if args.name == "ledger":
            ledger = LedgerStage(
                sink,
                LedgerConfig(seal_grace_s=args.seal_grace, max_open_s=args.max_open, remember=args.remember),
            )
            await serve_stage(
                ledger,
                config,
                sink,
                stage="ledger",
                group=args.group or LEDGER_GROUP,
                topics=ledger_topics(config.names),
                stop=stop,
                tuning=tuning,
                metrics=metrics,
                lag_interval_s=args.lag_interval,
            )
            return
        from pipeline.dataplane import DataPlaneConfig, open_data_plane

        plane_config = DataPlaneConfig.from_env(
            mode=args.dataplane_mode, data_dir=args.data_dir, ray_address=args.ray_address
        )
        async with open_data_plane(plane_config) as plane:
            finalizer = FinalizerStage(
                metrics.data_plane(plane),
                sink,
                policy=MixedVersionPolicy(args.mixed_versions),
                remember=args.remember,
            )
            await serve_stage(
                finalizer,
                config,
                sink,
                stage="finalizer",
                group=args.group or FINALIZER_GROUP,
                topics=finalizer_topics(config.names),
                stop=stop,
                tuning=tuning,
                metrics=metrics,
                lag_interval_s=args.lag_interval,
            )
