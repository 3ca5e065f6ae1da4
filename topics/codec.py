"""Wire codec: an envelope becomes (key, value, headers) bytes, and back.

The payload is orjson; the envelope (type, schema version, event id) rides in the
record headers so that a consumer can route or dead-letter a record without parsing
its body. Every failure is a ``DecodeError`` naming the field and the reason.

Events are bounded (``MAX_EVENT_BYTES``): ``encode`` refuses a bigger payload with an
``EventTooLarge`` naming the event, and ``decode`` refuses a bigger record before
parsing it, so one runaway producer cannot make a stage parse or hold gigabytes. A
dead letter is the last resort for bad input and must always be writable:
``fit_dead_letter`` trims one that would exceed the bound.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from pydantic import ValidationError

from topics.events import PAYLOAD_TYPES, Envelope, EventType, envelope
from topics.records import READABLE_EVENT_SCHEMAS, DeadLetter, Record

HEADER_TYPE = "tt-type"
HEADER_SCHEMA = "tt-schema"
HEADER_EVENT_ID = "tt-event-id"

Headers = list[tuple[str, bytes]]

MAX_EVENT_BYTES = 4 * 2**20
"""Largest record (key + value + headers) the codec writes or reads. Producers must
accept a request this large plus framing (``KafkaEventSink`` does), and so must the
broker (Kafka's ``message.max.bytes``; tansu has no limit)."""

DEAD_LETTER_TEXT_CHARS = 1024
"""How much of a text field (key, header value, reason) an oversized dead letter keeps."""
DEAD_LETTER_HEADERS = 64
"""How many headers an oversized dead letter keeps."""


class DecodeError(ValueError):
    """A record that cannot become a valid event; ``field`` says where, ``reason`` why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class EventTooLarge(ValueError):
    """An event too large to write; names the event, its size and the limit it broke
    (``limit`` is None when only a broker's refusal says so)."""

    def __init__(
        self, event_id: str, event_type: str, size: int, limit: int | None, what: str = "event limit"
    ) -> None:
        bound = (
            f"over the {limit}-byte {what}" if limit is not None else f"refused as too large by the {what}"
        )
        super().__init__(f"event {event_id} ({event_type}) is {size} bytes encoded, {bound}")
        self.event_id = event_id
        self.event_type = event_type
        self.size = size
        self.limit = limit


def record_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]]) -> int:
    """Bytes of a record's key, value and headers (what the event limit bounds)."""
    size = len(key or b"") + len(value or b"")
    for name, raw in headers:  # a plain loop: this runs for every record read
        size += len(raw) + (len(name) if name.isascii() else len(name.encode("utf-8", "surrogatepass")))
    return size


def encode_payload(payload: Record) -> bytes:
    """pydantic's Rust serializer writes the same JSON as orjson would, about 5x faster.
    Called directly: ``model_dump_json`` is a Python wrapper that returns the same bytes
    decoded to a string, which would be encoded straight back."""
    return payload.__pydantic_serializer__.to_json(payload)


def encode(event: Envelope[Record]) -> tuple[bytes, bytes, Headers]:
    """Key, value and headers for one Kafka record; raises ``EventTooLarge`` over the limit."""
    key, value, headers = _encode(event)
    size = record_size(key, value, headers)
    if size > MAX_EVENT_BYTES:
        raise EventTooLarge(event.event_id, event.event_type.value, size, MAX_EVENT_BYTES)
    return key, value, headers


def _encode(event: Envelope[Record]) -> tuple[bytes, bytes, Headers]:
    headers: Headers = [
        (HEADER_TYPE, event.event_type.value.encode()),
        (HEADER_SCHEMA, str(event.schema_version).encode()),
        (HEADER_EVENT_ID, event.event_id.encode()),
    ]
    return event.key.encode(), encode_payload(event.payload), headers


def encode_record(payload: Record) -> tuple[bytes, bytes, Headers]:
    return encode(envelope(payload))


def record_type(headers: Sequence[tuple[str, bytes]]) -> bytes | None:
    """A record's type header as written (the first), without decoding anything: what a
    consumer that reads only some types on a topic looks at first."""
    for name, value in headers:
        if name == HEADER_TYPE:
            return value
    return None


def _envelope_headers(headers: Sequence[tuple[str, bytes]]) -> dict[str, bytes]:
    """The type, schema and event-id headers (the first of each name), found in one pass."""
    found: dict[str, bytes] = {}
    for name, value in headers:
        if name in _ENVELOPE_HEADERS and name not in found:
            found[name] = value
    return found


def _header(found: dict[str, bytes], name: str) -> str:
    raw = found.get(name)
    if raw is None:
        raise DecodeError(f"header {name}", "missing")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"header {name}", "not UTF-8") from None


_ENVELOPE_HEADERS = (HEADER_TYPE, HEADER_SCHEMA, HEADER_EVENT_ID)
_EVENT_TYPES = {kind.value: kind for kind in EventType}
_READABLE_SCHEMAS = frozenset(str(version) for version in READABLE_EVENT_SCHEMAS)


def decode_payload(event_type: EventType, value: bytes) -> Record:
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("value", f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DecodeError("value", f"expected a JSON object, got {type(raw).__name__}")
    try:
        # The validator itself: ``model_validate`` is a Python wrapper around this call.
        record: Record = PAYLOAD_TYPES[event_type].__pydantic_validator__.validate_python(raw)
        return record
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise DecodeError(*_field_and_reason(first["loc"], first["msg"])) from None


# A model's own rule names its field first: "Value error, staging_chain: key ...".
_FIELD_IN_MESSAGE = re.compile(r"^(?:Value error, )?([a-z_][a-z0-9_.]*): (.*)$", re.DOTALL)


def _field_and_reason(loc: Sequence[int | str], message: str) -> tuple[str, str]:
    """The dotted path of a validation error and its reason. A rule checked across
    fields names its field in the message: that field joins the path, so the error
    reads ``staging_chain`` or ``coords.staging_chain`` rather than ``payload``."""
    path = [str(part) for part in loc]
    match = _FIELD_IN_MESSAGE.match(message)
    if match is None:
        return ".".join(path) or "payload", message.removeprefix("Value error, ")
    if not path or path[-1] != match.group(1):
        path.append(match.group(1))
    return ".".join(path), match.group(2)


def decode(
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]],
    *,
    max_bytes: int = MAX_EVENT_BYTES,
) -> Envelope[Record]:
    """Rebuild and validate an envelope; the id and key must match the payload's meaning.

    A record over ``max_bytes`` is refused before anything in it is parsed.
    """
    size = record_size(key, value, headers)
    if size > max_bytes:
        key_size, value_size = len(key or b""), len(value or b"")
        parts = {"value": value_size, "key": key_size, "headers": size - key_size - value_size}
        largest = max(parts, key=parts.__getitem__)  # the part that made it too big
        raise DecodeError(largest, f"record is {size} bytes, over the {max_bytes}-byte event limit")
    found = _envelope_headers(headers)
    type_name = _header(found, HEADER_TYPE)
    event_type = _EVENT_TYPES.get(type_name)
    if event_type is None:
        raise DecodeError(f"header {HEADER_TYPE}", f"unknown event type {type_name!r}")
    schema = _header(found, HEADER_SCHEMA)
    if schema not in _READABLE_SCHEMAS:
        raise DecodeError(
            f"header {HEADER_SCHEMA}",
            f"unsupported schema version {schema!r}; this reader knows {READABLE_EVENT_SCHEMAS}",
        )
    if value is None:
        raise DecodeError("value", "missing (tombstone)")
    payload = decode_payload(event_type, value)
    event = envelope(payload)
    if event.event_type != event_type:
        raise DecodeError(f"header {HEADER_TYPE}", f"says {type_name}, payload is {event.event_type}")
    event_id = _header(found, HEADER_EVENT_ID)
    if event_id != event.event_id:
        raise DecodeError(f"header {HEADER_EVENT_ID}", f"{event_id!r} != expected {event.event_id!r}")
    if key is None:  # a keyless record lands on a random partition, away from its rollout
        raise DecodeError("key", f"missing (records are keyed by rollout, here {event.key!r})")
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("key", f"not UTF-8 (records are keyed by rollout, here {event.key!r})") from None
    if text != event.key:
        raise DecodeError("key", f"record key does not match rollout {event.key!r}")
    return event


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A record as it lies in the log: where it is, and its bytes untouched."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


def raw_record(topic: str, partition: int, offset: int, event: Envelope[Record]) -> RawRecord:
    """The wire form of a decoded event (for one that was never read from a log)."""
    key, value, headers = _encode(event)
    return RawRecord(topic, partition, offset, key, value, headers)


def dead_letter(raw: RawRecord, reason: str, field: str | None, stage: str) -> DeadLetter:
    """The one way to refuse input: the record whole (raw value, every header), why it
    was refused, and where it is. ``fit_dead_letter`` trims it when it is written."""
    return DeadLetter(
        source_topic=raw.topic,
        source_partition=raw.partition,
        source_offset=raw.offset,
        reason=reason,
        field=field,
        key=None if raw.key is None else raw.key.decode("utf-8", "backslashreplace"),
        headers={name: value.decode("utf-8", "backslashreplace") for name, value in raw.headers},
        value_b64=base64.b64encode(raw.value or b"").decode("ascii"),
        stage=stage,
    )


def fit_dead_letter(letter: DeadLetter, max_bytes: int = MAX_EVENT_BYTES) -> DeadLetter:
    """``letter`` itself if it can be written, else a copy trimmed until it can.

    A dead letter carries the refused record whole (base64, a third larger), so a record
    near or over the event limit would make its own dead letter unwritable, and the
    stage would fail on it again at every restart. The trimmed copy keeps the value's
    first bytes with ``value_truncated_from`` set to its full size, and cuts long text
    fields (key, header values, reason) with a marker; the whole record stays in the
    source topic at the offset the letter names.
    """
    if _letter_size(letter) <= max_bytes:
        return letter
    raw = base64.b64decode(letter.value_b64)
    texts: dict[str, object] = {
        "reason": _cut(letter.reason),
        "field": None if letter.field is None else _cut(letter.field),
        "key": None if letter.key is None else _cut(letter.key),
        "headers": _cut_headers(letter.headers),
    }
    trimmed = letter.model_copy(update={**texts, "value_b64": ""})
    room = max_bytes - _letter_size(trimmed) - 32  # 32: room for the size field's digits
    keep = max(0, room) * 3 // 4
    return trimmed.model_copy(
        update={
            "value_b64": base64.b64encode(raw[:keep]).decode("ascii"),
            "value_truncated_from": letter.value_truncated_from or len(raw),
        }
    )


def _letter_size(letter: DeadLetter) -> int:
    return record_size(*_encode(envelope(letter)))


def _cut_headers(headers: dict[str, str]) -> dict[str, str]:
    items = list(headers.items())
    kept = {_cut(name): _cut(value) for name, value in items[:DEAD_LETTER_HEADERS]}
    if len(items) > DEAD_LETTER_HEADERS:
        kept["…"] = f"[{len(items) - DEAD_LETTER_HEADERS} more headers]"
    return kept


def _cut(text: str) -> str:
    if len(text) <= DEAD_LETTER_TEXT_CHARS:
        return text
    return f"{text[:DEAD_LETTER_TEXT_CHARS]}…[{len(text)} chars]"
