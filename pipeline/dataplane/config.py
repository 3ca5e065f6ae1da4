"""Which data plane a tokentrail process uses, and how long it waits on it.

Three modes, one protocol (``stages.ports.DataPlane``):

- ``embedded``: this process owns a TransferQueue controller and one storage unit,
  bound to loopback, and publishes their addresses for local peers (DESIGN §3).
- ``attach``: join a data plane another local process owns, through its published
  address file (or the JSON in ``TOKENTRAIL_DATAPLANE_ADDRESSES``).
- ``ray``: join a TransferQueue already running on a Ray cluster.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, cast, get_args

from pydantic import Field

from pipeline.process.datadir import DEFAULT_DATA_DIR
from pipeline.process.flags import Flag

DataPlaneMode = Literal["embedded", "attach", "ray"]

ADDRESSES_FILE_NAME = "dataplane.json"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RAY_NAMESPACE = "transfer_queue"

ENV_MODE = "TOKENTRAIL_DATAPLANE_MODE"
ENV_DATA_DIR = "TOKENTRAIL_DATA_DIR"
ENV_ADDRESSES_FILE = "TOKENTRAIL_DATAPLANE_ADDRESSES_FILE"
ENV_ADDRESSES = "TOKENTRAIL_DATAPLANE_ADDRESSES"
ENV_TIMEOUT_S = "TOKENTRAIL_DATAPLANE_TIMEOUT_S"
ENV_RAY_ADDRESS = "TOKENTRAIL_RAY_ADDRESS"


AddressesFlag = Annotated[
    Path | None,
    Flag(metavar="FILE"),
    Field(
        description=(
            f"address file the data plane published (`tokentrail dataplane`); default: ${ENV_ADDRESSES_FILE}, "
            f"else ${ENV_DATA_DIR}/{ADDRESSES_FILE_NAME} (.tokentrail when unset)"
        )
    ),
]
"""``--dataplane-addresses FILE``: how every verb that reads or writes rows names the data plane."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8 and ::1; an embedded data plane never listens elsewhere."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


RESTAGE_GRACE_S = 30.0
"""How long the finalizer waits for rows missing from a data plane that has just started:
as long as it waits for the owner itself (``OWNER_WAIT_S``), since the workers put their
rows back only once they have found the new owner; at 10 s the fault suite, run beside
other tests on a 2-core host, once counted rows of an owner kill lost that it finds alone."""
SLOT_REUSE_AFTER_S = 120.0
"""How long an embedded data plane holds a deleted row's slot before a new row may take it;
every client's deadline (``timeout_s``) must stay below it (``pipeline.dataplane.embedded``)."""
OWNER_WAIT_S = 30.0
"""How long the finalizer waits for a dead owner's successor instead of failing its batch:
a stage that died with the owner would lose the sample copies it keeps (DESIGN §7.4)."""


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    """Settings of the data plane; every field has a single-machine default.

    ``timeout_s`` bounds every data-plane call: TransferQueue's own RPCs have no
    timeout, so without it a dead controller hangs the caller forever.
    ``restage_grace_s``: for a reader that decides rows are lost (the finalizer), how long
    after an owner started missing rows are waited for, as workers stage them again.
    ``owner_wait_s``: how long a call that failed because the owner died waits for a new
    owner to be published before it fails (0: at once, as a worker's capture should).
    """

    mode: DataPlaneMode = "embedded"
    data_dir: Path = DEFAULT_DATA_DIR
    addresses_file: Path | None = None
    host: str = DEFAULT_HOST
    timeout_s: float = DEFAULT_TIMEOUT_S
    ray_address: str | None = None
    ray_namespace: str = DEFAULT_RAY_NAMESPACE
    staging_partition: str = "staging"
    samples_partition: str = "samples"
    restage_grace_s: float = 0.0
    owner_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in get_args(DataPlaneMode):
            raise ValueError(f"mode: expected one of {get_args(DataPlaneMode)}, got {self.mode!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.mode == "embedded" and not is_loopback(self.host):
            raise ValueError(f"host: an embedded data plane binds loopback only, got {self.host!r}")
        if self.staging_partition == self.samples_partition:
            raise ValueError("samples_partition: must differ from staging_partition")

    @property
    def addresses_path(self) -> Path:
        """Where the owner publishes its addresses and where attachers look for them."""
        return self.addresses_file if self.addresses_file is not None else self.data_dir / ADDRESSES_FILE_NAME

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /, **overrides: object) -> DataPlaneConfig:
        """Build from ``TOKENTRAIL_*`` variables; keyword overrides win over the environment."""
        source = os.environ if env is None else env
        values: dict[str, object] = {}
        if ENV_MODE in source:
            values["mode"] = cast(DataPlaneMode, source[ENV_MODE])
        if ENV_DATA_DIR in source:
            values["data_dir"] = Path(source[ENV_DATA_DIR])
        if ENV_ADDRESSES_FILE in source:
            values["addresses_file"] = Path(source[ENV_ADDRESSES_FILE])
        if ENV_TIMEOUT_S in source:
            values["timeout_s"] = float(source[ENV_TIMEOUT_S])
        if ENV_RAY_ADDRESS in source:
            values["ray_address"] = source[ENV_RAY_ADDRESS]
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
