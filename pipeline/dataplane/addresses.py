"""The published addresses of a data plane: what another process needs to attach.

A TransferQueue client needs exactly two things: the controller's ZMQ endpoints and
the storage units' endpoints. The owner of an embedded data plane writes them to a
small JSON file (atomically, with its pid) and can hand the same JSON to child
processes through an environment variable; an attacher turns them back into
TransferQueue's ``ZMQServerInfo`` objects and builds the ordinary client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline.dataplane.config import ENV_ADDRESSES
from stages.ports import DataPlaneError

ADDRESSES_VERSION = 1


class AddressesError(DataPlaneError, ValueError):
    """An address file or document that cannot be used to attach (so: no data plane)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One ZMQ server of TransferQueue: its id, host and named ports."""

    id: str
    ip: str
    ports: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "ip": self.ip, "ports": dict(self.ports)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Endpoint:
        if not isinstance(data, dict):
            raise AddressesError(f"{where}: expected an object, got {type(data).__name__}")
        ident, ip, ports = data.get("id"), data.get("ip"), data.get("ports")
        if not isinstance(ident, str) or not isinstance(ip, str):
            raise AddressesError(f"{where}: 'id' and 'ip' must be strings")
        if not isinstance(ports, dict) or not all(
            isinstance(k, str) and type(v) is int and 0 < v < 65536 for k, v in ports.items()
        ):
            raise AddressesError(f"{where}: 'ports' must map names to port numbers")
        return cls(id=ident, ip=ip, ports=dict(ports))

    @classmethod
    def from_server_info(cls, info: Any) -> Endpoint:
        """From TransferQueue's ``ZMQServerInfo`` (duck-typed: id, ip, ports)."""
        return cls(id=str(info.id), ip=str(info.ip), ports={str(k): int(v) for k, v in info.ports.items()})

    def address(self, port_name: str) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"tcp://{host}:{self.ports[port_name]}"


@dataclass(frozen=True, slots=True)
class DataPlaneAddresses:
    """Controller and storage-unit endpoints, plus who published them and when."""

    controller: Endpoint
    storage_units: tuple[Endpoint, ...]
    mode: str = "embedded"
    pid: int | None = None
    transferqueue_version: str | None = None
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not self.storage_units:
            raise AddressesError("storage_units: at least one storage unit is required")
        for name in ("handshake_socket", "request_handle_socket"):
            if name not in self.controller.ports:
                raise AddressesError(f"controller: missing port {name!r}")
        for unit in self.storage_units:
            if "put_get_socket" not in unit.ports:
                raise AddressesError(f"storage unit {unit.id}: missing port 'put_get_socket'")

    @property
    def controller_address(self) -> str:
        """The controller's request endpoint, for error messages and logs."""
        return self.controller.address("request_handle_socket")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": ADDRESSES_VERSION,
            "mode": self.mode,
            "pid": self.pid,
            "transferqueue_version": self.transferqueue_version,
            "created_at": self.created_at,
            "controller": self.controller.to_dict(),
            "storage_units": [unit.to_dict() for unit in self.storage_units],
        }

    def to_json(self) -> str:
        return orjson.dumps(self.to_dict()).decode()

    @classmethod
    def from_dict(cls, data: Any) -> DataPlaneAddresses:
        if not isinstance(data, dict):
            raise AddressesError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("version") != ADDRESSES_VERSION:
            raise AddressesError(
                f"version: this reader knows {ADDRESSES_VERSION}, got {data.get('version')!r}"
            )
        units = data.get("storage_units")
        if not isinstance(units, list):
            raise AddressesError("storage_units: expected a list")
        pid = data.get("pid")
        created_at = data.get("created_at")
        return cls(
            controller=Endpoint.from_dict(data.get("controller"), "controller"),
            storage_units=tuple(Endpoint.from_dict(u, f"storage_units[{i}]") for i, u in enumerate(units)),
            mode=str(data.get("mode", "embedded")),
            pid=pid if type(pid) is int else None,
            transferqueue_version=data.get("transferqueue_version"),
            created_at=float(created_at) if isinstance(created_at, int | float) else 0.0,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> DataPlaneAddresses:
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise AddressesError(f"not JSON: {exc}") from None
        return cls.from_dict(data)

    def write(self, path: Path) -> Path:
        """Publish atomically: readers see the old file or the whole new one, never a part."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Path) -> DataPlaneAddresses:
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            raise AddressesError(
                f"{path}: no data-plane address file; start one with `tokentrail dataplane`"
            ) from None
        try:
            return cls.from_json(text)
        except AddressesError as exc:
            raise AddressesError(f"{path}: {exc}") from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DataPlaneAddresses | None:
        """The addresses a parent process exported in ``TOKENTRAIL_DATAPLANE_ADDRESSES``, if any."""
        text = (os.environ if env is None else env).get(ENV_ADDRESSES)
        return None if not text else cls.from_json(text)

    def owner_alive(self) -> bool | None:
        """Whether the publishing process still runs (None when unknown, e.g. Ray mode)."""
        if self.pid is None:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def remove_if_owned(path: Path, pid: int) -> bool:
    """Delete an address file only if ``pid`` published it; a newer owner's file stays."""
    try:
        current = DataPlaneAddresses.read(path)
    except AddressesError:
        return False
    if current.pid != pid:
        return False
    path.unlink(missing_ok=True)
    return True
