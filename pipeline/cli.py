"""The ``tokentrail`` command line. Each verb lives in its own module under
``pipeline.commands`` and registers itself through ``add_parser``; installed packages
add verbs through the ``tokentrail.verbs`` entry-point group (``bench`` does)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

# Verb modules, in the order ``--help`` lists them.
VERBS: tuple[str, ...] = (
    "run",
    "drive",
    "broker",
    "dataplane",
    "worker",
    "gateway",
    "stage",
    "lag",
    "replay",
    "ledger",
    "samples",
    "mismatch",
    "inspect",
    "make_tiny_model",
    "mint_credentials",
)
PLUGIN_GROUP = "tokentrail.verbs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokentrail",
        description="Exact token capture for RL rollouts, recorded as events and verified into samples.",
    )
    subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name in VERBS:
        importlib.import_module(f"pipeline.commands.{name}").add_parser(subparsers)
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        entry.load()(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
