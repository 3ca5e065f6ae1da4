"""``tokentrail lag``: consumer lag per group, topic and partition.

Lag is highwater − committed, with exact watermarks on Kafka and on the embedded broker
alike (``--broker-kind``; see ``pipeline.kafka.lag``). A broker that
cannot be reached is not lag: it is reported as down, with its own exit code. Nor is a
commit below the log start: those records were deleted (by retention) before the group
read them, and each such range is named on stderr, with an exit code of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.errors import BROKER_UNREACHABLE
from pipeline.kafka.lag import LagError
from pipeline.kafka.lag_report import down_report, lost_ranges, print_table, read_lag, report, table
from pipeline.kafka.lag_settings import LagSettings
from pipeline.process.flags import add_flags, from_flags

EXIT_BROKER_DOWN = 3
"""Exit code when the broker cannot be reached (lag unknown, not zero)."""
EXIT_RECORDS_LOST = 4
"""Exit code when a group's commit lies below a partition's log start: records it never read are gone."""

EXAMPLES = """\
examples:
  tokentrail lag --bootstrap 127.0.0.1:9092
  tokentrail lag --bootstrap 127.0.0.1:9092 --group ledger --group finalizer
  tokentrail lag --bootstrap kafka:9092 --topic tokentrail.admission --json
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lag",
        help="show consumer lag (highwater - committed) per group and partition",
        description=(
            "Show consumer lag (highwater - committed) per group, topic and partition.\n"
            "Without --group every group is shown; without --topic, every topic where a\n"
            "group has committed offsets. A partition the group never committed on counts\n"
            "from the log start. Exits 3 (and says the broker is down) when the broker\n"
            "cannot be reached, and 4 when a group committed below a partition's log start:\n"
            "the log deleted records (retention) before the group read them; each lost range\n"
            "is named on stderr and in the table's lost column (the JSON's lost list)."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_arguments(parser, bootstrap_required=True, topic_layout=False)
    add_flags(parser, LagSettings)
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(LagSettings, args)
    try:
        rows = asyncio.run(read_lag(config_from_args(args), settings.group, settings.topic))
    except BROKER_UNREACHABLE as exc:
        if args.json:
            print(json.dumps(down_report(args.bootstrap, exc), sort_keys=True))
        print(f"tokentrail lag: broker down: cannot reach {args.bootstrap} ({exc})", file=sys.stderr)
        return EXIT_BROKER_DOWN
    except (ConfigError, LagError, KafkaError, OSError) as exc:
        print(f"tokentrail lag: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report(args.bootstrap, rows), sort_keys=True))
    else:
        print_table(table(rows))
    lost = lost_ranges(rows)
    for gone in lost:
        print(f"tokentrail lag: LOST: {gone}", file=sys.stderr)
    return EXIT_RECORDS_LOST if lost else 0
