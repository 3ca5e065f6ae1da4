"""``tokentrail replay``: rebuild the token-free ledger from the log into SQLite."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.flags import FlagError, add_flags, from_flags
from pipeline.process.heap import collect_per_batch
from pipeline.replay.job import print_report, replays
from pipeline.replay.parallel import ShardFailed
from pipeline.replay.rebuild import LogGone
from pipeline.replay.settings import ReplaySettings

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
    add_flags(parser, ReplaySettings)
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    collect_per_batch()
    try:
        job = from_flags(ReplaySettings, args, show_progress=not args.json)
        for report in replays(config_from_args(args), job):
            print_report(report, as_json=args.json)
            if report.get("differences"):
                return 1
    except (ConfigError, FlagError) as exc:
        print(f"tokentrail replay: {exc}", file=sys.stderr)
        return 2
    except (ShardFailed, LogGone) as exc:
        print(f"tokentrail replay: {exc}", file=sys.stderr)
        return 1
    return 0
