"""The data plane: heavy token rows and finalized samples in TransferQueue.

``TransferQueueDataPlane`` implements ``stages.ports.DataPlane``; ``EmbeddedDataPlane``
runs TransferQueue's controller and one storage unit inside a tokentrail process; other
processes attach through the addresses it publishes. ``open_data_plane(config)`` picks
the mode a ``DataPlaneConfig`` names.

Names resolve lazily: importing the configuration or the address file does not pull in
torch, Ray or TransferQueue (``tokentrail --help`` stays fast).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.dataplane.addresses import AddressesError, DataPlaneAddresses, Endpoint
    from pipeline.dataplane.config import DataPlaneConfig, DataPlaneMode
    from pipeline.dataplane.embedded import (
        EmbeddedDataPlane,
        EmbeddedStartError,
        embedded_data_plane,
        start_embedded,
    )
    from pipeline.dataplane.encoding import RowFormatError
    from pipeline.dataplane.runtime import attach_data_plane, open_data_plane
    from pipeline.dataplane.transferqueue import CorruptRows, TransferQueueDataPlane

_HOMES = {
    "AddressesError": "addresses",
    "DataPlaneAddresses": "addresses",
    "Endpoint": "addresses",
    "DataPlaneConfig": "config",
    "DataPlaneMode": "config",
    "EmbeddedDataPlane": "embedded",
    "EmbeddedStartError": "embedded",
    "embedded_data_plane": "embedded",
    "start_embedded": "embedded",
    "RowFormatError": "encoding",
    "open_data_plane": "runtime",
    "attach_data_plane": "runtime",
    "CorruptRows": "transferqueue",
    "TransferQueueDataPlane": "transferqueue",
}

__all__ = [
    "AddressesError",
    "CorruptRows",
    "DataPlaneAddresses",
    "DataPlaneConfig",
    "DataPlaneMode",
    "EmbeddedDataPlane",
    "EmbeddedStartError",
    "Endpoint",
    "RowFormatError",
    "TransferQueueDataPlane",
    "attach_data_plane",
    "embedded_data_plane",
    "open_data_plane",
    "start_embedded",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
