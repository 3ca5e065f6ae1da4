"""``tokentrail replay``: rebuild the token-free ledger from the log into SQLite."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.heap import collect_per_batch
from pipeline.replay.continued import DEFAULT_MARGIN_S, rebuild_continued
from pipeline.replay.parallel import ShardFailed, rebuild_parallel
from pipeline.replay.rebuild import LogGone, compare, materialize
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig

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


def parse_offsets(values: list[str]) -> dict[TopicPartition, int]:
    offsets: dict[TopicPartition, int] = {}
    for value in values:
        try:
            where, offset = value.rsplit("=", 1)
            topic, partition = where.rsplit(":", 1)
            offsets[TopicPartition(topic, int(partition))] = int(offset)
        except ValueError:
            raise ConfigError(f"--from: {value!r} is not TOPIC:PARTITION=OFFSET") from None
    return offsets


def run(args: argparse.Namespace) -> int:
    collect_per_batch()
    while True:
        try:
            _check_flags(args)
            report = asyncio.run(_replay(args))
        except ConfigError as exc:
            print(f"tokentrail replay: {exc}", file=sys.stderr)
            return 2
        except (ShardFailed, LogGone) as exc:
            print(f"tokentrail replay: {exc}", file=sys.stderr)
            return 1
        _print(report, as_json=args.json)
        if report.get("differences") or args.every is None:
            return 1 if report.get("differences") else 0
        time.sleep(args.every)


def _check_flags(args: argparse.Namespace) -> None:
    if args.checkpoints is None:
        if args.every is not None:
            raise ConfigError("--every: keeps a checkpoint current, so it needs --checkpoints")
        return
    if args.offsets:
        raise ConfigError("--from: a rebuild from checkpoints starts where the newest one ends")
    if args.processes != 1:
        raise ConfigError("--processes: a rebuild from checkpoints runs in one process")


def _print(report: dict[str, Any], *, as_json: bool) -> None:
    for line in report.get("skipped_checkpoints", []):
        print(f"tokentrail replay: passed over {line}", file=sys.stderr)
    if as_json:
        print(json.dumps(report, sort_keys=True), flush=True)
        return
    if "checkpoint" in report:
        print(
            f"continued from {report['resumed_from'] or 'the log start'} "
            f"({report['events_before']} events before it); new checkpoint {report['checkpoint']}"
        )
    print(f"replayed {report['events']} events into {report['out']}: {report['stored']}", flush=True)
    for line in report.get("differences", [])[:20]:
        print(f"  {line}")


async def _replay(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    ledger = LedgerConfig(seal_grace_s=args.seal_grace)
    report: dict[str, Any] = {"out": str(args.out)}
    with Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=args.json or not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("replay", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        if args.checkpoints is not None:
            continued = await rebuild_continued(
                config,
                args.out,
                args.checkpoints,
                ledger=ledger,
                margin_s=args.checkpoint_margin,
                progress=progress,
            )
            result = continued.result
            report |= {
                "resumed_from": continued.resumed_from,
                "events_before": continued.events_before,
                "checkpoint": continued.checkpoint,
                "skipped_checkpoints": continued.skipped,
            }
        else:
            with LedgerStore(args.out) as store:
                result = await rebuild_parallel(
                    config,
                    store,
                    processes=args.processes,
                    ledger=ledger,
                    start=parse_offsets(args.offsets),
                    progress=progress,
                )
    report |= {
        "events": result.events,
        "undecodable": result.undecodable,
        "stored": result.stored,
        "open_rollouts": result.open_rollouts,
    }
    if args.check:
        with LedgerStore(args.out) as store, LedgerStore(args.out.with_suffix(".live.sqlite")) as live:
            await materialize(config, live)
            report["differences"] = compare(store, live)
    return report
