"""``tokentrail broker``: run the embedded Kafka-protocol broker in the foreground.

Prints the bootstrap address once the broker answers, then runs until SIGINT or
SIGTERM (a clean stop) or until the broker dies (exit code 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.kafka.config import ConfigError, add_topic_layout_arguments, topic_names_from_args
from pipeline.kafka.embedded.broker import STORAGE_MODES, BrokerError, StoreLockedError
from pipeline.kafka.embedded.foreground import (
    ForegroundBroker,
    TopicsToCreate,
    serve_in_foreground,
    storage_for,
)
from pipeline.kafka.retention import add_retention_argument, retention_from_args
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from stages.ledger.stage import LedgerConfig

EXIT_STORE_LOCKED = 3
"""Exit code when the durable store is held by another live broker."""

EXAMPLES = """\
examples:
  tokentrail broker                                  # memory storage, a free port
  tokentrail broker --port 9092 --create-topics
  tokentrail broker --port 9092 --create-topics --retention admission=5d --retention staged=5d
  tokentrail broker --storage durable --data-dir ./tt-broker --port 9092

--create-topics sets each topic's retention (--retention, DESIGN §7.6) and refuses one
shorter than the ledger's --max-open plus an hour. tansu records retention but never
deletes a record: a durable store keeps the whole log.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "broker",
        help="run the embedded Kafka-protocol broker (tansu) in the foreground",
        description=(
            "Run the embedded tansu broker until SIGINT/SIGTERM and print its bootstrap address.\n"
            "'memory' storage forgets everything on stop; 'durable' keeps topics, records and\n"
            "committed offsets in --data-dir (an S3-compatible store kept as folders).\n"
            "One broker per store: a second one on a store in use exits 3 naming the holder.\n"
            "The broker's processes die with this one, also on SIGKILL."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    parser.add_argument("--port", type=int, help="listen port (default: a free port)")
    parser.add_argument(
        "--storage",
        choices=STORAGE_MODES,
        help="storage engine (default: durable with --data-dir, else memory)",
    )
    parser.add_argument("--data-dir", help="data directory (required for durable storage; holds logs)")
    parser.add_argument(
        "--create-topics", action="store_true", help="create the tokentrail topics once the broker is up"
    )
    add_topic_layout_arguments(parser)
    add_retention_argument(parser)
    parser.add_argument(
        "--max-open",
        type=float,
        default=LedgerConfig().max_open_s,
        help=(
            "with --create-topics: the --max-open of the ledger these topics serve; no topic may keep "
            "its records for less than that plus 1h (default %(default)s, tokentrail stage's)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document when ready")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    if args.retention and not args.create_topics:
        print(
            "tokentrail broker: --retention sets the topics --create-topics creates; add it", file=sys.stderr
        )
        return 2
    retention = retention_from_args(args.retention)
    try:
        if args.create_topics:
            retention.check(args.max_open)
    except ValueError as exc:
        print(f"tokentrail broker: {exc}", file=sys.stderr)
        return 2
    try:
        topics = TopicsToCreate(topic_names_from_args(args), retention) if args.create_topics else None
    except ConfigError as exc:
        print(f"tokentrail broker: {exc}", file=sys.stderr)
        return 1
    settings = ForegroundBroker(
        storage=storage_for(args.storage, args.data_dir),
        data_dir=args.data_dir,
        host=args.host,
        port=args.port,
        topics=topics,
        as_json=args.json,
    )
    guard_descendants(
        Path(args.data_dir) if args.data_dir else None, role="broker"
    )  # tansu and its store die with this process
    try:
        serve_in_foreground(settings)
    except StoreLockedError as exc:
        print(f"tokentrail broker: {exc}", file=sys.stderr)
        return EXIT_STORE_LOCKED
    except (BrokerError, ConfigError, KafkaError, OSError) as exc:
        print(f"tokentrail broker: {exc}", file=sys.stderr)
        return 1
    return 0
