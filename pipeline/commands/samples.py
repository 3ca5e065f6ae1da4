"""``tokentrail samples export``: accepted samples from a data directory's archive, for a trainer.

The archive (``DATA_DIR/samples.jsonl``) is written by ``tokentrail run``: it is the
durable copy of every accepted sample, because TransferQueue keeps samples in memory
and they vanish when the process owning the data plane exits.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.samples.archive import archive_path, read_archive
from pipeline.samples.export import FORMATS, write_jsonl, write_parquet

EXAMPLES = """\
examples:
  tokentrail samples export --data-dir .tokentrail --format jsonl | head -n 1
  tokentrail samples export --data-dir .tokentrail --format parquet --out samples.parquet
  tokentrail samples export --data-dir .tokentrail --format jsonl --run run-20250101-120000-ab12cd --out r.jsonl --json

Each object: run_id, rollout_id, group_id, token_ids, token_mask (0 prompt/tool tokens,
1 generated), logprobs (of the sampled tokens; 0.0 where the mask is 0),
weight_versions (per token), reward, cumulative_hash, spans (per call: call_id,
start, carry_len, gen_len).
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "samples",
        help="export accepted samples archived by `tokentrail run`",
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
    export.add_argument(
        "--data-dir", type=Path, default=Path(".tokentrail"), help="data directory (default: %(default)s)"
    )
    export.add_argument(
        "--format", choices=FORMATS, default="jsonl", help="output format (default: %(default)s)"
    )
    export.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="output file (default: stdout; required for parquet and --json)",
    )
    export.add_argument("--run", dest="run_id", metavar="RUN_ID", help="only the samples of this run")
    export.add_argument("--json", action="store_true", help="print one JSON summary document on stdout")
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.out is None and (args.format == "parquet" or args.json):
        reason = "parquet output" if args.format == "parquet" else "--json (stdout carries the summary)"
        print(f"tokentrail samples export: --out is required with {reason}", file=sys.stderr)
        return 2
    source = archive_path(args.data_dir)
    if not args.data_dir.is_dir():
        print(f"tokentrail samples export: {args.data_dir} is not a directory", file=sys.stderr)
        return 1
    contents = read_archive(source, run_id=args.run_id)
    if contents.skipped_lines:
        print(
            f"tokentrail samples export: skipped {contents.skipped_lines} unreadable line(s) in {source}",
            file=sys.stderr,
        )
    try:
        if args.format == "parquet":
            count = write_parquet(contents.records, args.out)
        elif args.out is None:
            count = _to_stdout(contents.records)
        else:
            with args.out.open("wb") as handle:
                count = write_jsonl(contents.records, handle)
    except OSError as exc:
        print(f"tokentrail samples export: {exc}", file=sys.stderr)
        return 1
    if args.json:
        document = {
            "archive": str(source),
            "format": args.format,
            "out": str(args.out),
            "samples": count,
            "runs": contents.runs,
            "skipped_lines": contents.skipped_lines,
            "duplicates_dropped": contents.duplicates,
        }
        print(json.dumps(document, sort_keys=True))
    return 0


def _to_stdout(records: list[dict[str, Any]]) -> int:
    """JSON lines on stdout; a reader that stops early (``| head``) is not an error."""
    try:
        return write_jsonl(records, sys.stdout.buffer)
    except BrokenPipeError:
        # Keep Python from complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return len(records)
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return len(records)
        raise
