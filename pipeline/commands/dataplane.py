"""``tokentrail dataplane``: run the embedded data plane in the foreground.

Useful when several tokentrail processes (workers, stages, a trainer) share one
machine: this process owns TransferQueue's controller and storage unit, publishes
their addresses to ``DATA_DIR/dataplane.json``, and every other process attaches
through that file. It stops on SIGINT or SIGTERM and removes the file it wrote.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.dataplane.foreground import DataPlaneInUse, limit_transferqueue_threads, serve_in_foreground
from pipeline.dataplane.settings import DataPlaneSettings
from pipeline.process.flags import add_flags, from_flags
from pipeline.process.heap import collect_per_batch
from pipeline.process.jsonlog import add_log_format_argument, configure_logging

EXAMPLE = """\
example:
  tokentrail dataplane --data-dir runs/exp1 --json &
  # other processes on this machine attach with
  #   TOKENTRAIL_DATAPLANE_MODE=attach TOKENTRAIL_DATA_DIR=runs/exp1
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "dataplane",
        help="run the embedded TransferQueue data plane in the foreground",
        description=(
            "Start TransferQueue's controller and one storage unit in this process, bound to "
            "loopback, publish their addresses to DATA_DIR/dataplane.json, and serve until "
            "SIGINT or SIGTERM."
        ),
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, DataPlaneSettings)
    parser.add_argument("--json", action="store_true", help="print the addresses as one JSON document")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    collect_per_batch()  # it serves rows and samples for as long as the pipeline runs
    limit_transferqueue_threads()
    try:
        config = from_flags(DataPlaneSettings, args).config()
    except ValueError as exc:
        sys.stderr.write(f"tokentrail dataplane: {exc}\n")
        return 2
    try:
        serve_in_foreground(config, as_json=args.json)
    except DataPlaneInUse as exc:
        sys.stderr.write(f"tokentrail dataplane: {exc}\n")
        return 1
    return 0
