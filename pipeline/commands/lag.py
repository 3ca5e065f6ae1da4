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
from dataclasses import asdict
from typing import Any

from aiokafka.errors import KafkaError
from rich.console import Console
from rich.table import Table

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.kafka.errors import BROKER_UNREACHABLE
from pipeline.kafka.lag import LagError, LagReader, LostRange, PartitionLag, lag_by_group, total_lag

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
    parser.add_argument("--group", action="append", metavar="GROUP", help="consumer group (repeatable)")
    parser.add_argument("--topic", action="append", metavar="TOPIC", help="topic (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        rows = asyncio.run(_read(args))
    except BROKER_UNREACHABLE as exc:
        if args.json:
            print(
                json.dumps({"bootstrap": args.bootstrap, "broker": "down", "error": str(exc)}, sort_keys=True)
            )
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


def lost_ranges(rows: list[PartitionLag]) -> list[LostRange]:
    return [lost for row in rows if (lost := row.lost) is not None]


def print_table(rendered: Table) -> None:
    """On a terminal at its width, else (a pipe, a log) as wide as the table needs."""
    console = Console()
    needed = console.measure(rendered, options=console.options.update(max_width=10_000)).maximum
    if not console.is_terminal or console.width < needed:
        console = Console(width=needed)
    console.print(rendered)


async def _read(args: argparse.Namespace) -> list[PartitionLag]:
    async with LagReader(config_from_args(args)) as reader:
        return await reader.lag(groups=args.group, topics=args.topic)


def report(bootstrap: str, rows: list[PartitionLag]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "bootstrap": bootstrap,
        "broker": "up",
        "total_lag": total_lag(rows),
        "groups": lag_by_group(rows),
        "partitions": [row.as_dict() for row in rows],
        "lost": [{**asdict(lost), "records": lost.records} for lost in lost_ranges(rows)],
    }


def table(rows: list[PartitionLag]) -> Table:
    """Names are never cut: their columns are as wide as the longest (see ``print_table``)."""
    out = Table(title="consumer lag", caption=f"total lag: {total_lag(rows)}")
    for name in ("group", "topic", "partition", "committed", "highwater", "lag", "lost"):
        named = name in ("group", "topic")
        out.add_column(
            name,
            justify="left" if named else "right",
            no_wrap=True,
            overflow="ignore" if named else "ellipsis",
        )
    for row in rows:
        committed = "-" if row.committed is None else str(row.committed)
        lost = "" if (gone := row.lost) is None else f"{gone.first}-{gone.end - 1}"
        out.add_row(
            row.group, row.topic, str(row.partition), committed, str(row.highwater), str(row.lag), lost
        )
    return out
