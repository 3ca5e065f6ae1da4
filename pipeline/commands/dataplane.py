"""``tokentrail dataplane``: run the embedded data plane in the foreground.

Useful when several tokentrail processes (workers, stages, a trainer) share one
machine: this process owns TransferQueue's controller and storage unit, publishes
their addresses to ``DATA_DIR/dataplane.json``, and every other process attaches
through that file. It stops on SIGINT or SIGTERM and removes the file it wrote.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from pipeline.dataplane.addresses import AddressesError, DataPlaneAddresses
from pipeline.dataplane.config import DEFAULT_HOST, DataPlaneConfig
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
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="directory for dataplane.json (default: $TOKENTRAIL_DATA_DIR or .tokentrail)",
    )
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help="loopback address to bind (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the addresses as one JSON document")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def _report(addresses: DataPlaneAddresses, path: Path, as_json: bool) -> None:
    if as_json:
        document: dict[str, Any] = {**addresses.to_dict(), "addresses_file": str(path)}
        sys.stdout.write(orjson.dumps(document).decode() + "\n")
    else:
        controller = addresses.controller
        sys.stdout.write(
            f"data plane serving (pid {addresses.pid}, TransferQueue {addresses.transferqueue_version})\n"
            f"  controller  {controller.id}  {controller.address('request_handle_socket')}"
            f"  (handshake {controller.address('handshake_socket')})\n"
        )
        for unit in addresses.storage_units:
            sys.stdout.write(f"  storage     {unit.id}  {unit.address('put_get_socket')}\n")
        sys.stdout.write(f"  addresses   {path}\nstop with Ctrl-C or SIGTERM\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    collect_per_batch()  # it serves rows and samples for as long as the pipeline runs
    # TransferQueue reads this at import; its default (8) oversubscribes small machines.
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))
    overrides: dict[str, object] = {"mode": "embedded", "host": args.host}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
        overrides["addresses_file"] = None
    try:
        config = DataPlaneConfig.from_env(**overrides)
    except ValueError as exc:
        sys.stderr.write(f"tokentrail dataplane: {exc}\n")
        return 2
    path = config.addresses_path
    try:
        existing = DataPlaneAddresses.read(path)
    except AddressesError:
        existing = None
    if existing is not None and existing.owner_alive():
        sys.stderr.write(
            f"tokentrail dataplane: {path} belongs to a running data plane (pid {existing.pid})\n"
        )
        return 1

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from pipeline.dataplane.embedded import EmbeddedDataPlane

        with EmbeddedDataPlane.start(host=config.host) as server:
            server.publish(path)
            _report(server.addresses, path, args.json)
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not args.json:
        sys.stdout.write("data plane stopped\n")
    return 0
