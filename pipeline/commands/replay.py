"""``tokentrail replay``: rebuild the token-free ledger from the log into SQLite."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.heap import collect_per_batch
from pipeline.replay.continued import DEFAULT_MARGIN_S
from pipeline.replay.job import ReplayJob, parse_start_offsets, print_report, replays
from pipeline.replay.parallel import ShardFailed
from pipeline.replay.rebuild import LogGone

EXAMPLES = """\
examples:
  tokentrail replay --bootstrap 127.0.0.1:9092 --out ledger.sqlite
  tokentrail replay --bootstrap 127.0.0.1:9092 --out ledger.sqlite --check
  tokentrail replay --bootstrap 127.0.0.1:9092 --out ledger.sqlite --processes 2
  tokentrail replay --bootstrap kafka:9092 --out l.sqlite --from tokentrail.admission:0=1200 --json
  tokentrail replay --bootstrap kafka:9092 --out l.sqlite --checkpoints ckpt/            # checkpoint + tail
  tokentrail replay --bootstrap kafka:9092 --out l.sqlite --checkpoints ckpt/ --every 300  # keep one current
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="rebuild the ledger from the log into a SQLite file",
        description=(
            "Re-run the ledger over the admission and staged topics (from the beginning, or\n"
            "from --from offsets) and write every call record and receipt into --out.\n"
            "--checkpoints DIR continues from the newest checkpoint there, reads only the\n"
            "log's tail, and cuts a new one; --every keeps doing so (a long-lived process).\n"
            "--check also copies the live ledger (the committed topic) and compares the two."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_kafka_arguments(parser, bootstrap_required=True)
    parser.add_argument("--out", type=Path, required=True, help="SQLite file to write")
    parser.add_argument(
        "--from",
        dest="offsets",
        action="append",
        default=[],
        metavar="TOPIC:PARTITION=OFFSET",
        help="start that partition at that offset instead of its beginning (repeatable)",
    )
    parser.add_argument(
        "--seal-grace", type=float, default=10.0, help="seconds a seal waited live (default 10)"
    )
    parser.add_argument(
        "--processes",
        type=_at_least_one,
        default=1,
        help="rebuild the partitions in this many processes, each its share (default 1)",
    )
    parser.add_argument(
        "--checkpoints",
        type=Path,
        metavar="DIR",
        help="continue from the newest checkpoint in DIR (else the log's start) and cut a new one",
    )
    parser.add_argument(
        "--checkpoint-margin",
        type=_seconds,
        default=DEFAULT_MARGIN_S,
        metavar="SECONDS",
        help=f"the new checkpoint covers the log up to this long before the replay began "
        f"(default {DEFAULT_MARGIN_S:g})",
    )
    parser.add_argument(
        "--every",
        type=_seconds,
        metavar="SECONDS",
        help="with --checkpoints: rebuild again this long after each rebuild ends, until stopped",
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the live ledger; exit 1 on a difference"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(run=run)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def replay_job(args: argparse.Namespace) -> ReplayJob:
    return ReplayJob(
        out=args.out,
        start=parse_start_offsets(args.offsets),
        seal_grace_s=args.seal_grace,
        processes=args.processes,
        checkpoints=args.checkpoints,
        checkpoint_margin_s=args.checkpoint_margin,
        every_s=args.every,
        check=args.check,
        show_progress=not args.json,
    )


def run(args: argparse.Namespace) -> int:
    collect_per_batch()
    try:
        job = replay_job(args)
        for report in replays(config_from_args(args), job):
            print_report(report, as_json=args.json)
            if report.get("differences"):
                return 1
    except ConfigError as exc:
        print(f"tokentrail replay: {exc}", file=sys.stderr)
        return 2
    except (ShardFailed, LogGone) as exc:
        print(f"tokentrail replay: {exc}", file=sys.stderr)
        return 1
    return 0
