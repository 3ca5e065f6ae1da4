"""Schema 4 reads schema 3: a log written by the schema-3 code goes through today's
codec, ledger and finalizer as if it had been written today (DESIGN §4.6)."""

from __future__ import annotations

import asyncio

from schema3 import schema3_log, schema3_rows

from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed
from topics.codec import decode, encode_record
from topics.events import Envelope, envelope
from topics.records import (
    EVENT_SCHEMA_VERSION,
    CallCoords,
    CallRecord,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    StagedEvent,
)


def decoded(topic: str) -> list[Envelope[Record]]:
    return [decode(r.key, r.value, r.headers) for r in schema3_log() if r.topic == topic]


def test_every_schema_3_event_decodes_into_the_schema_4_record() -> None:
    for record in schema3_log():
        assert dict(record.headers)["tt-schema"] == b"3"
        event = decode(record.key, record.value, record.headers)
        assert event.payload.schema_version == EVENT_SCHEMA_VERSION
        again = decode(*encode_record(event.payload))  # and it is written back as schema 4
        assert again.payload == event.payload
    staged = [e.payload for e in decoded("staged")]
    assert staged and all(isinstance(s, StagedEvent) and type(s.coords) is CallCoords for s in staged)


def test_the_schema_4_ledger_decides_a_schema_3_log_as_the_schema_3_ledger_did() -> None:
    inputs = decoded("admission") + decoded("staged")
    sink = RecordingSink()
    ledger = LedgerStage(sink, LedgerConfig(seal_grace_s=1.0))
    asyncio.run(ledger.handle([Consumed("in", 0, i, e, 1.0) for i, e in enumerate(inputs)]))
    then = {e.event_id: e.payload for e in decoded("committed")}
    now = {e.event_id: e.payload for e in sink.events}
    assert now == then
    assert sum(isinstance(p, RolloutReceipt) for p in now.values()) == 3
    assert sum(isinstance(p, CallRecord) for p in now.values()) == 9


def test_a_schema_3_receipt_finalizes_against_its_rows() -> None:
    plane = MemoryDataPlane()
    asyncio.run(plane.put_calls(schema3_rows()))
    receipts = [e for e in decoded("committed") if isinstance(e.payload, RolloutReceipt)]
    sink = RecordingSink()
    stage = FinalizerStage(plane, sink)
    asyncio.run(stage.handle([Consumed("committed", 0, i, e) for i, e in enumerate(receipts)]))
    finalized = sink.payloads(FinalizedEvent)
    assert [f.status for f in finalized] == ["accepted"] * 3  # type: ignore[attr-defined]
    assert [f.call_count for f in finalized] == [3] * 3  # type: ignore[attr-defined]
    assert envelope(finalized[0]).event_id.startswith("fin/v3-")
