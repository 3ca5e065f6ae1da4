"""A minimal, blocking Kafka probe: ApiVersions and the cluster id from Metadata.

The broker supervisor judges readiness by a real protocol answer rather than by an
open port or an exit code (tansu exits 0 when its port is taken), and compares the
cluster id so that another broker already listening on the port is never mistaken
for the one just started. It is blocking and dependency-free so the supervisor can
use it from a plain thread, inside or outside an event loop.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

API_VERSIONS = 18
METADATA = 3
_CLIENT_ID = b"tokentrail-probe"
_MAX_RESPONSE = 16 * 1024 * 1024


class ProbeError(OSError):
    """The endpoint did not answer like a Kafka broker."""


@dataclass(frozen=True, slots=True)
class BrokerIdentity:
    """What a broker says about itself: its API ranges and its cluster id."""

    api_versions: dict[int, tuple[int, int]]
    cluster_id: str | None
    advertised: tuple[tuple[str, int], ...]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ProbeError("truncated Kafka response")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str | None:
        (length,) = self.take(">h")
        if length < 0:
            return None
        raw = self.data[self.pos : self.pos + length]
        if len(raw) != length:
            raise ProbeError("truncated Kafka string")
        self.pos += length
        return raw.decode("utf-8", "replace")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ProbeError("connection closed before a full Kafka response")
        chunks += chunk
    return bytes(chunks)


def _request(sock: socket.socket, api_key: int, version: int, correlation: int, body: bytes) -> _Reader:
    header = struct.pack(">hhih", api_key, version, correlation, len(_CLIENT_ID)) + _CLIENT_ID
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4))
    if not 4 <= size <= _MAX_RESPONSE:
        raise ProbeError(f"implausible Kafka response size {size}")
    reader = _Reader(_recv_exact(sock, size))
    (answered,) = reader.take(">i")
    if answered != correlation:
        raise ProbeError(f"correlation id {answered} != {correlation}")
    return reader


def identify(host: str, port: int, timeout: float = 1.0) -> BrokerIdentity:
    """ApiVersions v0 then Metadata v2 (no topics) on one connection."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        reader = _request(sock, API_VERSIONS, 0, 1, b"")
        (error,) = reader.take(">h")
        if error != 0:
            raise ProbeError(f"ApiVersions error code {error}")
        (count,) = reader.take(">i")
        versions: dict[int, tuple[int, int]] = {}
        for _ in range(max(count, 0)):
            key, low, high = reader.take(">hhh")
            versions[key] = (low, high)
        if METADATA not in versions or versions[METADATA][1] < 2:
            return BrokerIdentity(versions, None, ())
        reader = _request(sock, METADATA, 2, 2, struct.pack(">i", 0))
        (brokers,) = reader.take(">i")
        advertised: list[tuple[str, int]] = []
        for _ in range(max(brokers, 0)):
            reader.take(">i")
            host_name = reader.string() or ""
            (broker_port,) = reader.take(">i")
            reader.string()
            advertised.append((host_name, broker_port))
        return BrokerIdentity(versions, reader.string(), tuple(advertised))
