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
from pipeline.kafka.embedded.broker import BrokerError, StoreLockedError
from pipeline.kafka.embedded.foreground import ForegroundBroker, TopicsToCreate, serve_in_foreground
from pipeline.kafka.embedded.objectstore import Upkeep
from pipeline.kafka.embedded.settings import BrokerSettings
from pipeline.kafka.retention import add_retention_argument, retention_from_args
from pipeline.process.flags import FlagError, add_flags, from_flags
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import add_log_format_argument, configure_logging

EXIT_STORE_LOCKED = 3
"""Exit code when the durable store is held by another live broker."""

EXAMPLES = """\
examples:
  tokentrail broker                                  # memory storage, a free port
  tokentrail broker --port 9092 --create-topics
  tokentrail broker --port 9092 --create-topics --retention admission=5d --retention staged=5d
  tokentrail broker --storage durable --data-dir ./tt-broker --port 9092

--create-topics sets each topic's retention (--retention, DESIGN §7.6) and refuses one
shorter than the ledger's --max-open plus an hour. A durable store deletes what that
retention has passed every --retention-check-s, and packs old batches into few.
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
    add_flags(parser, BrokerSettings)
    add_topic_layout_arguments(parser)
    add_retention_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document when ready")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    given = retention_from_args(args.retention) if args.retention else None
    try:
        broker = from_flags(BrokerSettings, args, retention=given)
    except FlagError as exc:
        print(f"tokentrail broker: {exc}", file=sys.stderr)
        return 2
    try:
        names = topic_names_from_args(args)
    except ConfigError as exc:
        print(f"tokentrail broker: {exc}", file=sys.stderr)
        return 1
    settings = ForegroundBroker(
        storage=broker.resolved_storage,
        data_dir=broker.data_dir,
        host=broker.host,
        port=broker.port,
        topics=TopicsToCreate(names, broker.topic_retention) if broker.create_topics else None,
        as_json=args.json,
        upkeep=Upkeep(retention_check_s=broker.retention_check_s),
    )
    guard_descendants(
        Path(broker.data_dir) if broker.data_dir else None, role="broker"
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
