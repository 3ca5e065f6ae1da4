"""``tokentrail samples export``: accepted samples from a data directory's archive, for a trainer.

The archive (``DATA_DIR/samples.jsonl``) is written by ``tokentrail run``: it is the
durable copy of every accepted sample, because TransferQueue keeps samples in memory
and they vanish when the process owning the data plane exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.flags import FlagError, add_flags, from_flags
from pipeline.process.jsonlog import add_log_format_argument, configure_logging
from pipeline.samples.archive import archive_path, read_archive
from pipeline.samples.export import export_summary, write_export
from pipeline.samples.settings import ExportSettings
from pipeline.stagehost.sample_archive import ArchiveSettings, archive_samples
from stages.ports import DataPlaneError

EXAMPLES = """\
examples:
  tokentrail samples export --data-dir .tokentrail --format jsonl | head -n 1
  tokentrail samples export --data-dir .tokentrail --format parquet --out samples.parquet
  tokentrail samples export --data-dir .tokentrail --format jsonl --run run-20250101-120000-ab12cd --out r.jsonl --json

Each object: run_id, rollout_id, group_id, token_ids, token_mask (0 prompt/tool tokens,
1 generated), logprobs (of the sampled tokens; 0.0 where the mask is 0),
weight_versions (per token), reward, cumulative_hash, spans (per call: call_id,
start, carry_len, gen_len, reward, sampling: its non-neutral sampling options, {} when
neutral, null when unknown),
unreplayable (a call applied an option no trainer can replay).
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "samples",
        help="export the samples `tokentrail run` archived, or archive a cluster's samples as they come",
        description="Work with the accepted samples archived in a data directory.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser(
        "export",
        help="write one object per accepted sample (JSON lines or Parquet)",
        description=(
            "Write one object per accepted sample from DATA_DIR/samples.jsonl, the durable\n"
            "archive `tokentrail run` keeps (TransferQueue holds samples in memory only).\n"
            "Each rollout appears once."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(export, ExportSettings)
    export.set_defaults(run=run)
    _add_archive(actions)


def _add_archive(actions: Any) -> None:
    archive = actions.add_parser(
        "archive",
        help="copy accepted samples from the data plane into rotated files, as a long-lived consumer",
        description=(
            "Consume tokentrail.finalized in a group of its own and write every accepted sample\n"
            "(export format, plus run_id = --label) to OUT/samples-<time>-<n>.jsonl or .parquet,\n"
            "rotated. For clusters without `tokentrail run`; stop with SIGTERM or Ctrl-C."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(archive, ArchiveSettings)
    add_kafka_arguments(archive, bootstrap_required=True)
    archive.add_argument("--json", action="store_true", help="print one JSON summary on stdout when stopped")
    add_log_format_argument(archive)
    archive.set_defaults(run=run_archive)


def run_archive(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    try:
        settings = from_flags(ArchiveSettings, args)
        kafka = config_from_args(args)
    except (ConfigError, FlagError) as exc:
        print(f"tokentrail samples archive: {exc}", file=sys.stderr)
        return 2
    try:
        stats = asyncio.run(archive_samples(kafka, settings))
    except (ConfigError, DataPlaneError, KafkaError, OSError) as exc:
        print(f"tokentrail samples archive: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"out": str(settings.out_dir), **dataclasses.asdict(stats)}, sort_keys=True))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        settings = from_flags(ExportSettings, args)
    except FlagError as exc:
        print(f"tokentrail samples export: {exc}", file=sys.stderr)
        return 2
    source = archive_path(settings.data_dir)
    if not settings.data_dir.is_dir():
        print(f"tokentrail samples export: {settings.data_dir} is not a directory", file=sys.stderr)
        return 1
    contents = read_archive(source, run_id=settings.run_id)
    if contents.skipped_lines:
        print(
            f"tokentrail samples export: skipped {contents.skipped_lines} unreadable line(s) in {source}",
            file=sys.stderr,
        )
    try:
        count = write_export(contents.records, settings.format, settings.out)
    except OSError as exc:
        print(f"tokentrail samples export: {exc}", file=sys.stderr)
        return 1
    if settings.as_json:
        print(
            json.dumps(export_summary(source, settings.format, settings.out, count, contents), sort_keys=True)
        )
    return 0
