"""Wire codec: an envelope becomes (key, value, headers) bytes, and back.

The payload is orjson; the envelope (type, schema version, event id) rides in the
record headers so that a consumer can route or dead-letter a record without parsing
its body. Every failure is a ``DecodeError`` naming the field and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from pydantic import ValidationError

from topics.events import PAYLOAD_TYPES, Envelope, EventType, envelope
from topics.records import SCHEMA_VERSION, Record

HEADER_TYPE = "tt-type"
HEADER_SCHEMA = "tt-schema"
HEADER_EVENT_ID = "tt-event-id"

Headers = list[tuple[str, bytes]]


class DecodeError(ValueError):
    """A record that cannot become a valid event; ``field`` says where, ``reason`` why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def encode_payload(payload: Record) -> bytes:
    """pydantic's Rust serializer writes the same JSON as orjson would, about 5x faster."""
    return payload.model_dump_json().encode()


def encode(event: Envelope[Record]) -> tuple[bytes, bytes, Headers]:
    """Key, value and headers for one Kafka record."""
    headers: Headers = [
        (HEADER_TYPE, event.event_type.value.encode()),
        (HEADER_SCHEMA, str(event.schema_version).encode()),
        (HEADER_EVENT_ID, event.event_id.encode()),
    ]
    return event.key.encode(), encode_payload(event.payload), headers


def encode_record(payload: Record) -> tuple[bytes, bytes, Headers]:
    return encode(envelope(payload))


def _header(headers: Sequence[tuple[str, bytes]], name: str) -> str:
    for key, value in headers:
        if key == name:
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                raise DecodeError(f"header {name}", "not UTF-8") from None
    raise DecodeError(f"header {name}", "missing")


def decode_payload(event_type: EventType, value: bytes) -> Record:
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("value", f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DecodeError("value", f"expected a JSON object, got {type(raw).__name__}")
    try:
        return PAYLOAD_TYPES[event_type].model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "payload"
        raise DecodeError(location, first["msg"]) from None


def decode(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]]) -> Envelope[Record]:
    """Rebuild and validate an envelope; the id and key must match the payload's meaning."""
    type_name = _header(headers, HEADER_TYPE)
    try:
        event_type = EventType(type_name)
    except ValueError:
        raise DecodeError(f"header {HEADER_TYPE}", f"unknown event type {type_name!r}") from None
    schema = _header(headers, HEADER_SCHEMA)
    if schema != str(SCHEMA_VERSION):
        raise DecodeError(f"header {HEADER_SCHEMA}", f"unsupported schema version {schema!r}")
    if value is None:
        raise DecodeError("value", "missing (tombstone)")
    payload = decode_payload(event_type, value)
    event = envelope(payload)
    if event.event_type != event_type:
        raise DecodeError(f"header {HEADER_TYPE}", f"says {type_name}, payload is {event.event_type}")
    event_id = _header(headers, HEADER_EVENT_ID)
    if event_id != event.event_id:
        raise DecodeError(f"header {HEADER_EVENT_ID}", f"{event_id!r} != expected {event.event_id!r}")
    if key is not None and key.decode("utf-8", "replace") != event.key:
        raise DecodeError("key", f"record key does not match rollout {event.key!r}")
    return event
