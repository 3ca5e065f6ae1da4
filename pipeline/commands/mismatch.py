"""``tokentrail mismatch SAMPLES --model DIR``: a past run's training-inference mismatch, offline.

Recomputes every generated token's logprob with a Hugging Face forward of ``--model``
(CPU works), replaying each call's recorded sampling options (DESIGN §4.7), and prints
the report every train step carries (§14.1) as one JSON document: audit a past run, or
a changed trainer (another dtype, other weights), without re-running anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.process.flags import add_flags, from_flags
from pipeline.trainer.audit_settings import AuditSettings

EXAMPLES = """\
examples:
  tokentrail samples export --data-dir .tokentrail --format jsonl --out samples.jsonl
  tokentrail mismatch samples.jsonl --model .tokentrail/tiny-model
  tokentrail mismatch samples.parquet --model .tokentrail/weights/step-2 --dtype bfloat16
  tokentrail mismatch samples.jsonl --model DIR --replay temperature   # what ignoring truncation costs

The report: k1, k3, log_ppl_diff, chi2_token, chi2_sequence, ess_token, ess_sequence,
ratio_min/mean/p99/max, max_abs_dev, corrections (token, sequence, geometric), buckets
(clean, straddled, lag, turn, after_tool, later), worst tokens, and the counts of tokens
without provenance or with options not replayed.
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "mismatch",
        help="recompute the training-inference mismatch report of exported samples with a model",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, AuditSettings)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.samples.export import ExportReadError, read_export
    from pipeline.trainer.offline_audit import audit_offline, provenance_note
    from stages.trainer.mismatch import Bounds

    settings = from_flags(AuditSettings, args)
    if not (settings.model_dir / "config.json").is_file():
        print(
            f"tokentrail mismatch: {settings.model_dir} is not a model directory (no config.json)",
            file=sys.stderr,
        )
        return 2
    try:
        samples = read_export(settings.samples)
    except (ExportReadError, ValueError, OSError) as exc:
        print(f"tokentrail mismatch: {exc}", file=sys.stderr)
        return 2
    if not samples:
        print(f"tokentrail mismatch: {settings.samples} holds no samples", file=sys.stderr)
        return 1
    try:
        report = audit_offline(
            settings.model_dir,
            samples,
            dtype=settings.dtype,
            policy_version=settings.policy_version,
            mode=settings.replay,
            batch_size=settings.batch_size,
            bounds=Bounds(worst=settings.worst),
        )
    except ValueError as exc:
        print(f"tokentrail mismatch: {exc}", file=sys.stderr)
        return 2
    if (note := provenance_note(report)) is not None:
        print(f"tokentrail mismatch: {note}", file=sys.stderr)
    print(json.dumps(report))
    return 0
