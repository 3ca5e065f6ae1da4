"""``tokentrail stage ledger|finalizer``: run one stage as a long-lived consumer."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.log import KafkaEventSink, ensure_topics
from pipeline.logs import configure_logging
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

EXAMPLES = """\
examples:
  tokentrail stage ledger --bootstrap 127.0.0.1:9092
  tokentrail stage ledger --bootstrap kafka:9092 --seal-grace 30 --group ledger-prod
  tokentrail stage finalizer --bootstrap 127.0.0.1:9092 --data-dir .tokentrail
  tokentrail stage finalizer --bootstrap kafka:9092 --dataplane-mode ray --ray-address auto --mixed-versions reject

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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging()
    try:
        asyncio.run(_serve(args))
    except ConfigError as exc:
        print(f"tokentrail stage: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    await ensure_topics(config)
    tuning = ConsumerTuning(
        session_timeout_ms=args.session_timeout_ms, heartbeat_interval_ms=args.heartbeat_ms
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with KafkaEventSink(config) as sink:
        if args.name == "ledger":
            ledger = LedgerStage(sink, LedgerConfig(seal_grace_s=args.seal_grace, max_open_s=args.max_open))
            await serve_stage(
                ledger,
                config,
                sink,
                stage="ledger",
                group=args.group or LEDGER_GROUP,
                topics=ledger_topics(config.names),
                stop=stop,
                tuning=tuning,
            )
            return
        from pipeline.dataplane import DataPlaneConfig, open_data_plane

        plane_config = DataPlaneConfig(
            mode=args.dataplane_mode, data_dir=args.data_dir, ray_address=args.ray_address
        )
        async with open_data_plane(plane_config) as plane:
            finalizer = FinalizerStage(plane, sink, policy=MixedVersionPolicy(args.mixed_versions))
            await serve_stage(
                finalizer,
                config,
                sink,
                stage="finalizer",
                group=args.group or FINALIZER_GROUP,
                topics=finalizer_topics(config.names),
                stop=stop,
                tuning=tuning,
            )
