"""The embedded data plane as a foreground process: start it, publish its addresses, say
where it is, and serve until SIGINT or SIGTERM (what ``tokentrail dataplane`` runs)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import orjson

from pipeline.dataplane.addresses import AddressesError, DataPlaneAddresses
from pipeline.dataplane.config import DataPlaneConfig
from pipeline.process.signals import stop_event_on_signals, wait_until


class DataPlaneInUse(RuntimeError):
    """The addresses file belongs to a data plane that is still running."""


def limit_transferqueue_threads() -> None:
    """TransferQueue reads this at import; its default (8) oversubscribes small machines."""
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))


def serve_in_foreground(config: DataPlaneConfig, *, as_json: bool) -> None:
    """Serve until SIGINT or SIGTERM, then remove the addresses file. Raises
    ``DataPlaneInUse`` when that file belongs to a running data plane."""
    path = config.addresses_path
    try:
        existing = DataPlaneAddresses.read(path)
    except AddressesError:
        existing = None
    if existing is not None and existing.owner_alive():
        raise DataPlaneInUse(f"{path} belongs to a running data plane (pid {existing.pid})")
    with stop_event_on_signals() as stop:
        from pipeline.dataplane.embedded import EmbeddedDataPlane  # TransferQueue and Ray: slow to import

        with EmbeddedDataPlane.start(host=config.host) as server:
            server.publish(path)
            report(server.addresses, path, as_json=as_json)
            wait_until(stop)
    if not as_json:
        sys.stdout.write("data plane stopped\n")


def report(addresses: DataPlaneAddresses, path: Path, *, as_json: bool) -> None:
    """Where the controller and storage units listen, on stdout."""
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
