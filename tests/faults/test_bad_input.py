"""Bad input, one test per case: where it ends up, naming which field or code, and that
the stages keep going.

"Nothing lost": every bad input ends up either on the dead-letter topic (naming the
field and the reason, with its raw bytes) or as the rejected outcome of its rollout (a
``FinalizedEvent`` whose reason is a failure code), and good rollouts published after
it are still accepted.

One run serves every broker case: the real ledger and finalizer (``serve_stage``,
in-process) on the session's tansu broker and a real in-process TransferQueue. Each
case publishes its input under its own rollout id, built from real captures (the
capture core writing real rows); raw records go through a plain ``AIOKafkaProducer``
so that each lands at a known offset, and its dead letter is found by that offset.
Good rollouts on every partition follow all the bad input. The worker's HTTP checks
run on a real uvicorn server around a scripted engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.broker import EmbeddedBroker
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.lag import LagReader
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.reader import assigned_reader
from pipeline.models.tiny import make_tiny_model
from pipeline.stagehost.runner import serve_stage
from pipeline.worker.main import WorkerConfig, WorkerServer, build_app, build_worker
from stages.capture.cache import ChainCache
from stages.capture.chat import ChatRenderer
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.engine import Generation, Sampling, VersionSpan
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.ledger.stage import LedgerConfig
from stages.memory import MemoryDataPlane, RecordingSink
from stages.specs import FINALIZER, LEDGER, STAGES, StageSettings
from topics import codec
from topics.codec import HEADER_EVENT_ID, HEADER_SCHEMA, HEADER_TYPE, MAX_EVENT_BYTES, EventTooLarge
from topics.names import TopicNames
from topics.records import (
    MAX_CHAIN_DEPTH,
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    DeadLetter,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedEvent,
)
from topics.wire import COORDS_FIELD

SECTION = "bad input"
GRACE_S = 3.0  # the ledger's seal grace: a case whose input never settles waits this long
RUN_DEADLINE_S = 90.0
GOOD_AFTER = 8  # good rollouts published after all the bad input

# ============================================================================ the table


@dataclass(frozen=True)
class Letter:
    """Where a bad record must end up: a dead letter from ``stage`` naming ``field``."""

    stage: str
    field: str | None
    reason: str  # a substring of the letter's reason

    def names(self, field: str | None) -> bool:
        return field == self.field


@dataclass(frozen=True)
class Raw:
    """One record sent exactly as given: any bytes, any key, any headers."""

    role: str  # the topic: "admission" | "staged" | "committed"
    value: bytes | None
    key: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    expect: Letter | None  # None: it must be used like any good record, not dead-lettered


Send = Record | Raw
Build = Callable[["Kit", str], Awaitable[list[Send]]]


@dataclass(frozen=True)
class Failed:
    """A call the receipt must list as failed, with this code and detail."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Case:
    name: str  # also the rollout id
    kind: str  # its row in the fault report
    build: Build
    outcome: str  # "accepted", or the rejection code of the case's rollout
    failed: tuple[Failed, ...] = ()
    reward: float | None = None


_KEEP: Any = object()


def headers_for(
    record: Record, *, type: Any = _KEEP, schema: Any = _KEEP, event_id: Any = _KEEP
) -> tuple[tuple[str, bytes], ...]:
    """The codec's headers for ``record``, with one replaced (bytes) or dropped (None)."""
    _, _, headers = codec.encode_record(record)
    changes = {HEADER_TYPE: type, HEADER_SCHEMA: schema, HEADER_EVENT_ID: event_id}
    out = [(name, value if changes[name] is _KEEP else changes[name]) for name, value in headers]
    return tuple((name, value) for name, value in out if value is not None)


def raw(
    record: Record,
    expect: Letter | None,
    *,
    role: str = "admission",
    value: Any = _KEEP,
    key: Any = _KEEP,
    headers: tuple[tuple[str, bytes], ...] | None = None,
    **header: Any,
) -> Raw:
    """``record`` as the codec writes it, with its value, key or a header replaced."""
    real_key, real_value, _ = codec.encode_record(record)
    return Raw(
        role=role,
        value=real_value if value is _KEEP else value,
        key=real_key if key is _KEEP else key,
        headers=headers if headers is not None else headers_for(record, **header),
        expect=expect,
    )


def with_fields(record: Record, **fields: Any) -> bytes:
    """``record``'s JSON with fields replaced, whatever the model would say about them."""
    return orjson.dumps({**record.model_dump(mode="json"), **fields})


# ============================================================================ real captures


@dataclass
class Chain:
    """A captured rollout: per call its admission and staged event."""

    rollout_id: str
    admissions: list[CaptureAdmission]
    staged: list[StagedEvent]

    @property
    def coords(self) -> list[CommitCoords]:
        return [s.coords for s in self.staged]

    def events(self, seal: RolloutSeal | None = None) -> list[Send]:
        """Admission, staged event, ..., then the seal."""
        out: list[Send] = []
        for admission, staged in zip(self.admissions, self.staged, strict=True):
            out += [admission, staged]
        return [*out, seal or completed(self.rollout_id)]


def completed(rollout_id: str, reward: float | None = None) -> RolloutSeal:
    return RolloutSeal(rollout_id=rollout_id, status="completed", reward=reward, sealed_at=time.time())


class Kit:
    """The real capture core on the real data plane; its events are kept, not published."""

    def __init__(self, plane: TransferQueueDataPlane) -> None:
        self.staged = RecordingSink()
        cache = ChainCache()
        self.writer = StagingWriter(plane, self.staged, worker_id="w-bad-input", batch_delay_s=0.0)
        self.core = CaptureCore(
            PrefixResolver(plane, cache, wait_s=0.2), self.writer, cache, ack_policy=AckPolicy.STAGED
        )
        self.client = RolloutClient(RecordingSink())
        self._seen: dict[str, list[int]] = {}

    async def call(self, admission: CaptureAdmission, turn: int) -> StagedEvent:
        """Serve and capture one call; an admission that lies is caught by the core."""
        prompt = [*self._seen.get(admission.rollout_id, []), 100 + turn, 101]
        generated = [200 + turn, 300 + turn]
        prepared = await self.core.prepare(admission)
        completion = self.core.complete(prepared, prompt, generated, [-0.5, -0.25], weight_version=0)
        coords = await completion.final_coords()
        if coords.disposition == "staged":
            self._seen[admission.rollout_id] = [*prompt, *generated]
        (event,) = [
            e.payload
            for e in self.staged.events
            if isinstance(e.payload, StagedEvent) and e.payload.coords == coords
        ]
        assert isinstance(event, StagedEvent)
        return event

    async def chain(self, rollout_id: str, turns: int = 2) -> Chain:
        admissions: list[CaptureAdmission] = []
        staged: list[StagedEvent] = []
        for turn in range(turns):
            admissions.append(self.client.admit(rollout_id, staged[-1].coords if staged else None))
            staged.append(await self.call(admissions[-1], turn))
        return Chain(rollout_id, admissions, staged)

    def child(self, chain: Chain, **lie: Any) -> tuple[CaptureAdmission, CaptureAdmission]:
        """The truthful admission of the next call on ``chain``, and a valid one that lies."""
        truth = self.client.admit(chain.rollout_id, chain.coords[-1])
        return truth, CaptureAdmission.model_validate({**truth.model_dump(), **lie})


def believed(admission: CaptureAdmission, served: StagedEvent) -> StagedEvent:
    """The staged event of a worker that believed ``admission`` (coords agree with it)."""
    key = admission.staging_key
    coords = {
        **served.coords.model_dump(),
        "parent_call_id": admission.parent_call_id,
        "mode": admission.mode,
        "prev_len": admission.prev_len,
        "cum_len": admission.prev_len + served.coords.delta_len,
        "staging_chain": [*(admission.staging_chain or []), key],
    }
    return served.model_copy(update={"coords": CommitCoords.model_validate(coords)})


def recoord(staged: StagedEvent, **fields: Any) -> StagedEvent:
    """``staged`` with its coords changed (still a valid record)."""
    coords = CommitCoords.model_validate({**staged.coords.model_dump(), **fields})
    return staged.model_copy(update={"coords": coords})


# ============================================================================ the cases


def slipped_in(make: Callable[[Chain], Raw], at: int = 1) -> Build:
    """A good two-call rollout with one bad record slipped in after its ``at``-th event."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid)
        events = chain.events()
        return [*events[:at], make(chain), *events[at:]]

    return build


def _field_lie(call: int, expect: Letter, **fields: Any) -> Callable[[Chain], Raw]:
    """A copy of call ``call``'s admission with fields the model refuses."""

    def make(chain: Chain) -> Raw:
        admission = chain.admissions[call]
        return raw(admission, expect, value=with_fields(admission, **fields))

    return make


def _huge_header(chain: Chain) -> Raw:
    first = chain.admissions[0]
    blob = ("x-blob", b"h" * (MAX_EVENT_BYTES + 8))
    return raw(first, Letter("ledger", "headers", OVER), headers=(*headers_for(first), blob))


def first_admission(expect: Letter, **changes: Any) -> Build:
    """A copy of the rollout's first admission, changed, slipped in after the original."""
    return slipped_in(lambda chain: raw(chain.admissions[0], expect, **changes))


async def _replaced_admission(kit: Kit, rid: str) -> list[Send]:
    """Call 2's admission arrives corrupted: dead-lettered, and its staged event then has
    no admission, which rejects the rollout (call 2 is its end)."""
    chain = await kit.chain(rid)
    events = chain.events()
    cut = codec.encode_payload(chain.admissions[1])[:-9]
    events[2] = raw(chain.admissions[1], Letter("ledger", "value", "not JSON"), value=cut)
    return events


async def _unknown_header(kit: Kit, rid: str) -> list[Send]:
    """The rollout's only copy of its first admission carries a header nobody knows."""
    chain = await kit.chain(rid)
    events = chain.events()
    first = chain.admissions[0]
    events[0] = raw(first, None, headers=(*headers_for(first), ("x-trace", b"\xff\x00 not utf-8")))
    return events


def _finalized_on_admission_topic(chain: Chain) -> Raw:
    final = FinalizedEvent(
        rollout_id=chain.rollout_id,
        status="rejected",
        rejection_reason="no_calls",
        prompt_len=0,
        total_len=0,
        generated_tokens=0,
        call_count=0,
        finalized_at=1.0,
    )
    return raw(final, Letter("ledger", TYPE, "does not belong on this topic"))


def _malformed_receipt(chain: Chain) -> Raw:
    letter = Letter("finalizer", "value", "not JSON")
    seal = completed(chain.rollout_id)  # its key and id headers, typed as a receipt
    return raw(seal, letter, role="committed", type=b"receipt", value=b'{"rollout_id": ')


def _huge_chain(chain: Chain) -> Raw:
    """An admission of 3.3 MB: a chain of 150,000 keys (its dead letter must be trimmed)."""
    admission = chain.admissions[1]
    keys = [f"{chain.rollout_id}/k{i}" for i in range(150_000)]
    value = with_fields(admission, staging_chain=[*keys, *(admission.staging_chain or [])])
    letter = Letter("ledger", "staging_chain", f"at most {MAX_CHAIN_DEPTH - 1} items")
    return raw(admission, letter, value=value)


def _lie(real_worker: bool, lie: Callable[[Chain], dict[str, Any]]) -> Build:
    """Call 2's admission lies. With ``real_worker`` the capture core serves the same
    admission (and catches the lie); otherwise a worker believed it and its coords
    agree with the lie, so only the ledger's lineage check is left to catch it."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid, turns=1)
        truth, lying = kit.child(chain, **lie(chain))
        staged = await kit.call(lying, 1) if real_worker else believed(lying, await kit.call(truth, 1))
        return [*chain.events()[:-1], lying, staged, completed(rid)]

    return build


async def _forged_chain_hash(kit: Kit, rid: str) -> list[Send]:
    """The worker was sent the truth; the admission on the log names another parent hash."""
    chain = await kit.chain(rid, turns=1)
    truth, lying = kit.child(chain, parent_chain_hash="0" * 64)
    return [*chain.events()[:-1], lying, await kit.call(truth, 1), completed(rid)]


def _foreign_parent(real_worker: bool) -> Build:
    """Call 2 names a call of another rollout as its parent: that call's id, chain hash
    and length (the chain key rewritten to this rollout, so the record is valid)."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        theirs = (await kit.chain(f"{rid}-other", turns=1)).coords[0]
        chain = await kit.chain(rid, turns=1)
        truth, lying = kit.child(
            chain,
            parent_call_id=theirs.call_id,
            staging_chain=[f"{rid}/{theirs.call_id}"],
            parent_chain_hash=theirs.chain_hash,
            prev_len=theirs.cum_len,
        )
        staged = await kit.call(lying, 1) if real_worker else believed(lying, await kit.call(truth, 1))
        return [*chain.events()[:-1], lying, staged, completed(rid)]

    return build


async def _foreign_chain_key(kit: Kit, rid: str) -> list[Send]:
    """Call 2's chain holds another rollout's key: not even a valid record. The worker
    refuses such a request (HTTP 400, below), so no staged event follows it, and the
    rollout ends on its first call."""
    theirs = (await kit.chain(f"{rid}-other", turns=1)).coords[0]
    chain = await kit.chain(rid, turns=1)
    truth, _ = kit.child(chain)
    value = with_fields(truth, staging_chain=[theirs.staging_key])
    letter = Letter("ledger", "staging_chain", "is not of rollout")
    return [*chain.events()[:-1], raw(truth, letter, value=value), completed(rid)]


def _coords_disagree(change: Callable[[Chain], dict[str, Any]]) -> Build:
    """Call 2's staged coords disagree with its admission."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid)
        events = chain.events()
        events[3] = recoord(chain.staged[1], **change(chain))
        return events

    return build


def _short_prefix(chain: Chain) -> dict[str, Any]:
    return {"prev_len": chain.coords[-1].cum_len - 1}


def _forged_ancestors(chain: Chain) -> dict[str, Any]:
    return {"staging_chain": [f"{chain.rollout_id}/x", *chain.coords[-1].staging_chain]}


def _zero_hash(chain: Chain) -> dict[str, Any]:
    return {"parent_call_id": chain.coords[-1].call_id, "parent_chain_hash": "0" * 64}


def _ghost_parent(chain: Chain) -> dict[str, Any]:
    return {"parent_call_id": "ghost", "staging_chain": [f"{chain.rollout_id}/ghost"]}


def _shifted(chain: Chain) -> dict[str, Any]:
    coords = chain.coords[1]
    return {"prev_len": coords.prev_len + 1, "cum_len": coords.cum_len + 1}


def _other_parent(chain: Chain) -> dict[str, Any]:
    key = chain.coords[1].staging_key
    return {"parent_call_id": "ghost", "staging_chain": [f"{chain.rollout_id}/ghost", key]}


def _longer_chain(chain: Chain) -> dict[str, Any]:
    return {"staging_chain": [f"{chain.rollout_id}/extra", *chain.coords[1].staging_chain]}


async def _seal_only(kit: Kit, rid: str) -> list[Send]:
    return [completed(rid)]


def _two_seals(second_reward: float, letter: Letter | None) -> Build:
    """Two seals while call 2 is still in flight, so both meet the open rollout."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid)
        first = completed(rid, reward=1.0)
        second = first.model_copy(update={"reward": second_reward})
        events = chain.events(first)
        return [*events[:3], first, raw(second, letter), events[3]]

    return build


async def _conflicting_admission(kit: Kit, rid: str) -> list[Send]:
    chain = await kit.chain(rid)
    events = chain.events()
    other = chain.admissions[1].model_copy(update={"group_id": "not-the-same"})
    events.insert(3, raw(other, Letter("ledger", "group_id", "conflicting admission")))
    return events


async def _orphan_staged(kit: Kit, rid: str) -> list[Send]:
    """A staged event of a call nobody admitted (a root beside the real chain)."""
    chain = await kit.chain(rid)
    orphan = await kit.call(kit.client.admit(rid), 9)
    return [*chain.events()[:-1], orphan, completed(rid)]


NOT_JSON = Letter("ledger", "value", "not JSON")
TYPE = f"header {HEADER_TYPE}"
SCHEMA = f"header {HEADER_SCHEMA}"
EVENT_ID = f"header {HEADER_EVENT_ID}"
OVER = f"over the {MAX_EVENT_BYTES}-byte event limit"
HUGE = b'{"padding": "' + b"a" * (MAX_EVENT_BYTES + 1024) + b'"}'

CASES: list[Case] = [
    # malformed JSON ------------------------------------------------------------------
    Case(
        "truncated-json",
        "malformed JSON event",
        first_admission(NOT_JSON, value=b'{"call_id": "c'),
        "accepted",
    ),
    Case(
        "binary-garbage",
        "malformed JSON event",
        first_admission(NOT_JSON, value=b"\x00\xff\xfe\x80"),
        "accepted",
    ),
    Case(
        "json-array",
        "malformed JSON event",
        first_admission(Letter("ledger", "value", "expected a JSON object"), value=b"[1, 2]"),
        "accepted",
    ),
    Case(
        "malformed-needed-admission",
        "malformed JSON event",
        _replaced_admission,
        "unknown_admission",
        failed=(Failed("unknown_admission", "without an admission"),),
    ),
    Case("malformed-receipt", "malformed JSON event", slipped_in(_malformed_receipt), "accepted"),
    Case(
        "tombstone",
        "tombstone (null value)",
        first_admission(Letter("ledger", "value", "tombstone"), value=None),
        "accepted",
    ),
    # invalid fields ------------------------------------------------------------------
    Case(
        "string-prev-len",
        "invalid field",
        slipped_in(_field_lie(0, Letter("ledger", "prev_len", "valid integer"), prev_len="0")),
        "accepted",
    ),
    Case(
        "extra-field",
        "invalid field",
        slipped_in(_field_lie(0, Letter("ledger", "surprise", "Extra inputs"), surprise=1)),
        "accepted",
    ),
    Case(
        "text-mode-with-parent",
        "invalid field",
        slipped_in(
            _field_lie(1, Letter("ledger", "parent_call_id", "text-mode call has no parent"), mode="text"),
            at=3,
        ),
        "accepted",
    ),
    # unknown event types, envelopes that disagree with their payload -----------------
    Case(
        "bogus-type",
        "unknown event type",
        first_admission(Letter("ledger", TYPE, "unknown event type 'bogus'"), type=b"bogus"),
        "accepted",
    ),
    Case(
        "missing-type",
        "unknown event type",
        first_admission(Letter("ledger", TYPE, "missing"), type=None),
        "accepted",
    ),
    Case(
        "type-says-seal",
        "unknown event type",
        first_admission(Letter("ledger", "status", "Field required"), type=b"seal"),
        "accepted",
    ),
    Case("wrong-topic", "unknown event type", slipped_in(_finalized_on_admission_topic), "accepted"),
    Case(
        "event-id-lie",
        "envelope disagrees with payload",
        first_admission(Letter("ledger", EVENT_ID, "!= expected"), event_id=b"adm/x/y"),
        "accepted",
    ),
    Case(
        "other-key",
        "envelope disagrees with payload",
        first_admission(Letter("ledger", "key", "does not match rollout"), key=b"someone-else"),
        "accepted",
    ),
    Case("unknown-header", "unknown header", _unknown_header, "accepted"),
    # schema versions -----------------------------------------------------------------
    Case(
        "schema-header-4",
        "unknown schema version",
        first_admission(Letter("ledger", SCHEMA, "unsupported schema version '4'"), schema=b"4"),
        "accepted",
    ),
    Case(
        "schema-header-2",
        "unknown schema version",
        first_admission(Letter("ledger", SCHEMA, "unsupported schema version '2'"), schema=b"2"),
        "accepted",
    ),
    Case(
        "schema-payload-9",
        "unknown schema version",
        slipped_in(
            _field_lie(
                0, Letter("ledger", "schema_version", "unsupported schema_version 9"), schema_version=9
            )
        ),
        "accepted",
    ),
    # keys ----------------------------------------------------------------------------
    Case(
        "nonutf8-key",
        "non-UTF-8 key",
        first_admission(Letter("ledger", "key", "not UTF-8"), key=b"\xff\xfebad"),
        "accepted",
    ),
    Case(
        "nonutf8-header",
        "non-UTF-8 key",
        first_admission(Letter("ledger", EVENT_ID, "not UTF-8"), event_id=b"adm/\xff\xfe"),
        "accepted",
    ),
    Case(
        "missing-key",
        "missing key",
        first_admission(Letter("ledger", "key", "missing"), key=None),
        "accepted",
    ),
    # huge payloads -------------------------------------------------------------------
    Case(
        "huge-value", "huge payload", first_admission(Letter("ledger", "value", OVER), value=HUGE), "accepted"
    ),
    Case("huge-header", "huge payload", slipped_in(_huge_header), "accepted"),
    Case("huge-chain", "huge payload", slipped_in(_huge_chain, at=3), "accepted"),
    # admissions that lie -------------------------------------------------------------
    Case(
        "prev-len-lie-served",
        "admission lies: wrong prev_len",
        _lie(True, _short_prefix),
        "prefix_hash_mismatch",
        failed=(Failed("prefix_hash_mismatch", "capture failed"),),
    ),
    Case(
        "prev-len-lie-believed",
        "admission lies: wrong prev_len",
        _lie(False, _short_prefix),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "does not continue parent"),),
    ),
    Case(
        "forged-chain-believed",
        "admission lies: forged chain",
        _lie(False, _forged_ancestors),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "does not continue parent"),),
    ),
    Case(
        "forged-chain-served",
        "admission lies: forged chain",
        _lie(True, _forged_ancestors),
        "prefix_unavailable",
        failed=(Failed("prefix_unavailable", "capture failed"),),
    ),
    Case(
        "forged-chain-hash-served",
        "admission lies: forged chain",
        _lie(True, _zero_hash),
        "prefix_hash_mismatch",
        failed=(Failed("prefix_hash_mismatch", "capture failed"),),
    ),
    Case(
        "forged-chain-hash-logged",
        "admission lies: forged chain",
        _forged_chain_hash,
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "does not continue parent"),),
    ),
    Case(
        "unknown-parent-served",
        "admission lies: unknown parent",
        _lie(True, _ghost_parent),
        "prefix_unavailable",
        failed=(Failed("prefix_unavailable", "capture failed"),),
    ),
    Case(
        "unknown-parent-believed",
        "admission lies: unknown parent",
        _lie(False, _ghost_parent),
        "unknown_admission",
    ),
    Case(
        "foreign-parent-served",
        "admission lies: parent from another rollout",
        _foreign_parent(True),
        "prefix_unavailable",
        failed=(Failed("prefix_unavailable", "capture failed"),),
    ),
    Case(
        "foreign-parent-believed",
        "admission lies: parent from another rollout",
        _foreign_parent(False),
        "unknown_admission",
    ),
    Case(
        "foreign-chain-key",
        "admission lies: parent from another rollout",
        _foreign_chain_key,
        "accepted",
    ),
    # coords that disagree with the admission -----------------------------------------
    Case(
        "coords-prev-len",
        "coords disagree with admission",
        _coords_disagree(_shifted),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "prev_len: staged"),),
    ),
    Case(
        "coords-parent",
        "coords disagree with admission",
        _coords_disagree(_other_parent),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "parent_call_id: staged 'ghost'"),),
    ),
    Case(
        "coords-chain",
        "coords disagree with admission",
        _coords_disagree(_longer_chain),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "staging_chain: staged"),),
    ),
    # seals and duplicates ------------------------------------------------------------
    Case("seal-unknown-rollout", "seal for unknown rollout", _seal_only, "no_calls"),
    Case("duplicate-seal", "duplicate seal", _two_seals(1.0, None), "accepted", reward=1.0),
    Case(
        "conflicting-seal",
        "duplicate seal",
        _two_seals(0.0, Letter("ledger", "reward", "conflicting seal")),
        "accepted",
        reward=1.0,
    ),
    Case(
        "conflicting-admission",
        "duplicate admission that differs",
        _conflicting_admission,
        "accepted",
    ),
    Case(
        "orphan-staged",
        "staged event without admission",
        _orphan_staged,
        "accepted",
        failed=(Failed("unknown_admission", "without an admission"),),
    ),
]


# ============================================================================ one run for all


@dataclass(frozen=True)
class Sent:
    case: str
    raw: Raw
    where: tuple[str, int, int]  # topic, partition, offset


@dataclass
class Run:
    """What one run of the stages made of every case's input."""

    names: TopicNames
    sent: list[Sent]
    good: list[str]
    letters: dict[tuple[str, int, int], list[DeadLetter]] = field(default_factory=lambda: defaultdict(list))
    finalized: dict[str, list[FinalizedEvent]] = field(default_factory=lambda: defaultdict(list))
    receipts: dict[str, list[RolloutReceipt]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, str] = field(default_factory=dict)  # a stage that stopped by itself: why
    publish_order: list[str] = field(default_factory=list)  # rollouts in the order published
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the run

    def letters_of(self, rollout_id: str) -> list[DeadLetter]:
        return [letter for found in self.letters.values() for letter in found if letter.key == rollout_id]


def good_rollout_ids(partitions: int, count: int) -> list[str]:
    """Rollout ids that, between them, land on every partition."""
    partitioner = DefaultPartitioner()
    everyone = list(range(partitions))
    chosen: list[str] = []
    covered: set[int] = set()
    for i in range(10_000):
        rid = f"good-after-{i}"
        partition = partitioner(rid.encode(), everyone, everyone)
        if partition not in covered or len(covered) == partitions:
            chosen.append(rid)
            covered.add(partition)
        if len(chosen) == count and len(covered) == partitions:
            return chosen
    raise AssertionError("no rollout ids cover every partition")


class Watch:
    """Reads the finalized, dead-letter and committed topics into a ``Run`` as they fill."""

    def __init__(self, config: KafkaConfig, run: Run) -> None:
        self.config = config
        self.run = run
        self.changed = asyncio.Event()

    async def follow(self, stop: asyncio.Event) -> None:
        names = self.config.names
        async with LagReader(self.config) as reader:
            partitions = await reader.partitions([names.finalized, names.deadletter, names.committed])
        async with assigned_reader(self.config, dict.fromkeys(partitions)) as consumer:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=100)
                for records in batch.values():
                    for record in records:
                        self._take(record.key, record.value, record.headers)
                if batch:
                    self.changed.set()

    def _take(self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]]) -> None:
        try:
            payload = codec.decode(key, value, headers).payload
        except codec.DecodeError:
            return  # the malformed receipt this suite put on the committed topic
        run = self.run
        match payload:
            case DeadLetter():
                where = (payload.source_topic, payload.source_partition, payload.source_offset)
                run.letters[where].append(payload)
            case FinalizedEvent():
                run.finalized[payload.rollout_id].append(payload)
            case RolloutReceipt():
                run.receipts[payload.rollout_id].append(payload)


async def publish(
    sends: Sequence[Send], case: str, sink: KafkaEventSink, producer: AIOKafkaProducer, names: TopicNames
) -> list[Sent]:
    """In order: records through the stages' own sink, raw ones through a plain producer
    (each awaited, so the order in the log is this order)."""
    topics = {"admission": names.admission, "staged": names.staged, "committed": names.committed}
    sent: list[Sent] = []
    records: list[Record] = []
    for item in sends:
        if not isinstance(item, Raw):
            records.append(item)
            continue
        await sink.publish(records)
        records = []
        topic = topics[item.role]
        future = await producer.send(topic, value=item.value, key=item.key, headers=list(item.headers))
        meta = await future
        sent.append(Sent(case, item, (topic, meta.partition, meta.offset)))
    await sink.publish(records)
    return sent


@contextlib.asynccontextmanager
async def stages_running(
    config: KafkaConfig, plane: TransferQueueDataPlane, run: Run
) -> AsyncIterator[dict[str, asyncio.Task[Any]]]:
    """The ledger and the finalizer consuming, each with its own producer, as in production."""
    stop = asyncio.Event()
    async with KafkaEventSink(config) as ledger_sink, KafkaEventSink(config) as finalizer_sink:
        settings = StageSettings(ledger=LedgerConfig(seal_grace_s=GRACE_S))
        sinks = {LEDGER.name: ledger_sink, FINALIZER.name: finalizer_sink}
        started = {name: asyncio.Event() for name in STAGES}
        tasks = {
            name: asyncio.create_task(
                serve_stage(
                    spec.build(sinks[name], plane, settings),
                    spec,
                    config,
                    sinks[name],
                    stop=stop,
                    tuning=FAST_GROUPS,
                    started=started[name],
                )
            )
            for name, spec in STAGES.items()
        }
        joined = asyncio.ensure_future(asyncio.gather(*(event.wait() for event in started.values())))
        await asyncio.wait([joined, *tasks.values()], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        try:
            yield tasks
        finally:
            for name, task in tasks.items():
                if task.done():
                    run.errors[name] = f"stopped by itself: {task.exception()!r}"
            stop.set()
            joined.cancel()
            for name, task in tasks.items():
                try:
                    await asyncio.wait_for(task, 30)
                except Exception as exc:
                    run.errors.setdefault(name, f"failed: {exc!r}")


async def run_all(config: KafkaConfig, plane: TransferQueueDataPlane) -> Run:
    names = config.names
    await ensure_topics(config)
    good = good_rollout_ids(names.partitions, GOOD_AFTER)
    run = Run(names, [], good)
    kit = Kit(plane)
    kit.writer.start()
    clock = time.monotonic()
    inputs = {case.name: await case.build(kit, case.name) for case in CASES}
    good_inputs = {rid: (await kit.chain(rid, turns=3)).events() for rid in good}
    await kit.writer.stop()
    expected_outcomes = {*inputs, *good}
    run.phases["capture"] = time.monotonic() - clock

    watch = Watch(config, run)
    stop_watch = asyncio.Event()
    follower = asyncio.create_task(watch.follow(stop_watch))
    producer = AIOKafkaProducer(
        **config.client_kwargs(), acks="all", enable_idempotence=False, max_request_size=4 * MAX_EVENT_BYTES
    )
    await producer.start()
    try:
        clock = time.monotonic()
        async with stages_running(config, plane, run) as tasks, KafkaEventSink(config, linger_ms=0) as sink:
            run.phases["stages start"] = time.monotonic() - clock
            clock = time.monotonic()
            for name, sends in {**inputs, **good_inputs}.items():  # every bad input first
                run.sent += await publish(sends, name, sink, producer, names)
                run.publish_order.append(name)
            run.phases["publish"] = time.monotonic() - clock
            clock = time.monotonic()
            letters_wanted = {s.where for s in run.sent if s.raw.expect is not None}
            deadline = time.monotonic() + RUN_DEADLINE_S
            complete_at: float | None = None
            while time.monotonic() < deadline and not any(t.done() for t in tasks.values()):
                if expected_outcomes <= run.finalized.keys():
                    complete_at = complete_at or time.monotonic()
                    # Letters a known gap never writes must not hold the run for long.
                    if letters_wanted <= run.letters.keys() or time.monotonic() - complete_at > 1.0:
                        break
                watch.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.changed.wait(), 0.5)
            await asyncio.sleep(0.5)  # a second outcome or letter for anything would show now
            run.phases["outcomes"] = time.monotonic() - clock
            clock = time.monotonic()
    finally:
        await producer.stop()
        stop_watch.set()
        await follower
    run.phases["stages stop"] = time.monotonic() - clock
    return run


@pytest.fixture(scope="module")
def bad_run(kafka_broker: EmbeddedBroker) -> Iterator[Run]:
    kafka_broker.check()
    config = kafka_broker.kafka_config(
        TopicNames(prefix=f"bad{uuid.uuid4().hex[:10]}", partitions=4), client_id="tokentrail-bad-input"
    )

    async def go(server: EmbeddedDataPlane) -> Run:
        async with await TransferQueueDataPlane.attach(server.addresses, timeout_s=20.0) as plane:
            return await run_all(config, plane)

    with EmbeddedDataPlane.start() as server:
        yield asyncio.run(go(server))


def describe(case: Case, sent: list[Sent]) -> str:
    letters = sorted({f"field={s.raw.expect.field}" for s in sent if s.raw.expect is not None})
    parts = [f"dead-lettered ({', '.join(letters)})"] if letters else ["used as sent"]
    parts.append("rollout accepted" if case.outcome == "accepted" else f"rejected: {case.outcome}")
    return "; ".join(parts)


def check_letter(sent: Sent, letters: list[DeadLetter]) -> None:
    expect = sent.raw.expect
    assert expect is not None
    assert letters, f"{sent.where}: no dead letter for {expect}"
    value = sent.raw.value or b""
    for letter in letters:  # redelivery may repeat a letter; every copy must be right
        assert letter.stage == expect.stage and expect.names(letter.field), letter
        assert expect.reason in letter.reason, letter.reason
        kept = base64.b64decode(letter.value_b64)
        if letter.value_truncated_from is None:
            assert kept == value, "a dead letter must keep the raw value"
        else:  # trimmed to stay writable: a prefix of the raw value and its full size
            assert letter.value_truncated_from == len(value) and value.startswith(kept) and kept
        assert codec.record_size(*codec.encode_record(letter)) <= MAX_EVENT_BYTES


@pytest.mark.broker
@pytest.mark.dataplane
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name) for c in CASES],
)
def test_bad_input_is_dead_lettered_or_rejects_its_rollout(
    case: Case, bad_run: Run, fault_report: Any
) -> None:
    assert not bad_run.errors, f"a stage did not survive the bad input: {bad_run.errors}"
    sent = [s for s in bad_run.sent if s.case == case.name]
    for item in sent:
        if item.raw.expect is None:
            assert bad_run.letters.get(item.where, []) == [], f"{item.where} was dead-lettered"
        else:
            check_letter(item, bad_run.letters.get(item.where, []))
    sources = {s.where for s in sent}
    stray = [
        letter
        for letter in bad_run.letters_of(case.name)
        if (letter.source_topic, letter.source_partition, letter.source_offset) not in sources
    ]
    assert stray == [], f"dead letters nobody expected: {stray}"

    outcomes = bad_run.finalized.get(case.name, [])
    assert len({o.model_dump_json(exclude={"finalized_at"}) for o in outcomes}) == 1, outcomes
    outcome = outcomes[0]
    if case.outcome == "accepted":
        assert (outcome.status, outcome.rejection_reason) == ("accepted", None), outcome
    else:
        assert (outcome.status, outcome.rejection_reason) == ("rejected", case.outcome), outcome
    if case.reward is not None:
        assert outcome.reward == case.reward
    receipts = bad_run.receipts.get(case.name, [])
    assert len({r.model_dump_json() for r in receipts}) == 1, f"receipts: {receipts}"
    receipt = receipts[0]
    assert receipt.failure_reason == (None if case.outcome == "accepted" else case.outcome)
    for failed in case.failed:
        assert any(
            f.reason == failed.reason and failed.detail in (f.detail or "") for f in receipt.failed_calls
        ), f"no failed call {failed} in {receipt.failed_calls}"

    fault_report.record(SECTION, case.kind, injected=1, survived=1, outcome=describe(case, sent))


@pytest.mark.broker
@pytest.mark.dataplane
def test_the_stages_survive_and_good_rollouts_published_after_the_bad_input_are_accepted(
    bad_run: Run,
) -> None:
    assert not bad_run.errors, f"a stage did not survive the bad input: {bad_run.errors}"
    assert bad_run.publish_order[-len(bad_run.good) :] == bad_run.good  # after every case
    partitioner = DefaultPartitioner()
    everyone = list(range(bad_run.names.partitions))
    assert {partitioner(rid.encode(), everyone, everyone) for rid in bad_run.good} == set(everyone)
    for rid in bad_run.good:
        outcomes = bad_run.finalized.get(rid, [])
        assert [o.status for o in outcomes] == ["accepted"], f"{rid}: {outcomes} ({bad_run.phases})"
        assert outcomes[0].call_count == 3
    assert all(bad_run.letters_of(rid) == [] for rid in bad_run.good)
    # Every dead letter due was written by a stage that went on.
    due = {s.where for s in bad_run.sent if s.raw.expect is not None}
    assert due <= bad_run.letters.keys()


# ============================================================================ producer side


def long_receipt(rollout_id: str, calls: int) -> RolloutReceipt:
    """The receipt of a linear rollout of ``calls`` calls: every record carries its whole
    chain, so the receipt grows with the square of the length."""
    records: list[CallRecord] = []
    chain: list[str] = []
    for i in range(calls):
        call_id = f"c{i:05d}"
        chain = [*chain, f"{rollout_id}/{call_id}"]
        records.append(
            CallRecord(
                rollout_id=rollout_id,
                call_id=call_id,
                parent_call_id=records[-1].call_id if records else None,
                mode="token_in" if records else "text",
                prev_len=2 * i,
                delta_len=2,
                cum_len=2 * i + 2,
                weight_version=0,
                staging_key=chain[-1],
                staging_chain=chain,
                chain_hash="a" * 64,
                cumulative_hash="b" * 64,
                digest="c" * 64,
                extras_digest="d" * 64,
                disposition="staged",
                admitted_at=1.0,
                staged_at=2.0,
            )
        )
    return RolloutReceipt(
        rollout_id=rollout_id,
        manifest=records,
        failed_calls=[],
        terminal_call_id=records[-1].call_id,
        terminal_selection="unique_leaf",
        capture_poisoned=False,
        sealed_at=3.0,
    )


@pytest.mark.broker
def test_an_event_too_large_to_publish_fails_naming_it_and_writes_nothing(
    kafka_config: KafkaConfig, fault_report: Any
) -> None:
    names = kafka_config.names
    huge = long_receipt("long-rollout", 700)  # a 700-turn rollout's receipt
    big = long_receipt("mid-rollout", 350)
    # The premise: one over the codec's limit, one under it but over a 1 MiB producer's.
    assert len(codec.encode_payload(huge)) > MAX_EVENT_BYTES
    assert MAX_EVENT_BYTES > codec.record_size(*codec.encode_record(big)) > 2**20

    async def go() -> tuple[list[str], int]:
        await ensure_topics(kafka_config)
        errors: list[str] = []
        async with KafkaEventSink(kafka_config) as sink:
            with pytest.raises(EventTooLarge) as over_codec:
                await sink.publish([huge])
            errors.append(str(over_codec.value))
        async with KafkaEventSink(kafka_config, max_request_size=2**20) as small:
            with pytest.raises(EventTooLarge) as over_producer:
                await small.publish([big])
            errors.append(str(over_producer.value))
            await small.publish([completed("after-the-refusal")])  # the sink still works
        async with LagReader(kafka_config) as reader:
            marks = await reader.watermarks(await reader.partitions([names.committed, names.admission]))
        written = {
            topic: sum(m.highwater for tp, m in marks.items() if tp.topic == topic)
            for topic in (names.committed, names.admission)
        }
        assert written == {names.committed: 0, names.admission: 1}
        return errors, len(errors)

    errors, count = asyncio.run(go())
    assert (
        "event rcp/long-rollout (receipt)" in errors[0]
        and f"over the {MAX_EVENT_BYTES}-byte event limit" in errors[0]
    )
    assert (
        "event rcp/mid-rollout (receipt)" in errors[1]
        and "over the 1048576-byte producer max_request_size" in errors[1]
    )
    fault_report.record(
        SECTION,
        "huge payload (producer side)",
        injected=count,
        survived=count,
        outcome="EventTooLarge names the event, size and limit; nothing written",
    )


# ============================================================================ the worker's HTTP

LIMIT = 64 * 1024  # the worker's body limit in these tests (the default is 8 MiB)
USER = [{"role": "user", "content": "Add 2 and 3."}]


class ScriptedEngine:
    """Generates ``max_tokens`` ids counting up from 300; remembers every prompt."""

    max_model_len = 256

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = [300 + i for i in range(sampling.max_tokens)]
        return Generation(
            ids, [-0.5] * len(ids), "The answer is 5.", "length", (VersionSpan("0", 0, len(ids)),)
        )

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def reload_weights(self, path: str) -> None:
        pass

    async def set_weight_version(self, version: str) -> None:
        pass

    def unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ChatRenderer]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)
    return model_dir, ChatRenderer.from_pretrained(model_dir)


@dataclass
class Worker:
    engine: ScriptedEngine
    data_plane: MemoryDataPlane
    sink: RecordingSink
    server: WorkerServer
    client: RolloutClient

    def captured(self) -> tuple[int, int]:
        """Staged events published and rows written so far."""
        return len(self.sink.events), len(self.data_plane.calls)


@contextlib.asynccontextmanager
async def worker_serving(tiny: tuple[Path, ChatRenderer]) -> AsyncIterator[Worker]:
    """A real uvicorn server (the worker's own) around the scripted engine."""
    model_dir, renderer = tiny
    engine, plane, sink = ScriptedEngine(), MemoryDataPlane(), RecordingSink()
    config = WorkerConfig(
        model_dir=model_dir, worker_id="w-bad", port=0, max_body_bytes=LIMIT, prefix_wait_s=0.05
    )
    worker = build_worker(config, engine, plane, sink, renderer=renderer)
    server = WorkerServer(build_app(worker, config), host="127.0.0.1", port=0, graceful_timeout_s=5)
    await server.start()
    try:
        yield Worker(engine, plane, sink, server, RolloutClient(RecordingSink()))
    finally:
        await server.stop()


async def raw_post(port: int, head: bytes, chunks: Sequence[bytes]) -> tuple[int, dict[str, Any]]:
    """Send a request head and then body chunks until the server answers; its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(reader.read())  # the server closes after a refusal
    try:
        writer.write(head)
        for chunk in chunks:
            if answer.done():
                break
            writer.write(chunk)
            try:
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break  # the server stopped reading: its answer is on the way
            await asyncio.sleep(0.001)
        data = await asyncio.wait_for(answer, 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), orjson.loads(body)


def chat_head(extra: str) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: worker\r\ncontent-type: application/json\r\n"
        f"{extra}\r\n\r\n"
    ).encode()


def chunked(body: bytes, size: int) -> list[bytes]:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts] + [b"0\r\n\r\n"]


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON of exactly ``size`` bytes (an ignored field takes the rest)."""
    bare = orjson.dumps({**body, "padding": ""})
    out = orjson.dumps({**body, "padding": "x" * (size - len(bare))})
    assert len(out) == size
    return out


def test_oversized_http_bodies_get_413_before_they_are_read(
    tiny: tuple[Path, ChatRenderer], fault_report: Any
) -> None:
    async def go() -> None:
        async with worker_serving(tiny) as w:
            request = w.client.request_body({"messages": USER, "max_tokens": 2}, w.client.admit("r-http"))
            oversized = padded(request, 4 * LIMIT)
            # A declared length over the limit: answered on the head alone, no body sent.
            status, error = await raw_post(w.server.port, chat_head(f"content-length: {len(oversized)}"), [])
            assert status == 413, error
            message = error["error"]["message"]
            assert error["error"]["code"] == "request_too_large", error
            assert f"the limit is {LIMIT} bytes" in message and "--max-body-bytes" in message
            # Chunked, so no length to judge by: refused once the count passes the limit.
            head = chat_head("transfer-encoding: chunked")
            status, error = await raw_post(w.server.port, head, chunked(oversized, 8 * 1024))
            assert status == 413 and error["error"]["code"] == "request_too_large", error
            assert w.engine.prompts == [] and w.captured() == (0, 0)

            # The worker keeps serving, and bodies of exactly the limit pass whole, in
            # one piece or streamed in chunks.
            json_type = {"content-type": "application/json"}
            async with httpx.AsyncClient(base_url=w.server.url, timeout=30) as http:
                whole = padded(request, LIMIT)
                reply = await http.post("/v1/chat/completions", content=whole, headers=json_type)
                assert reply.status_code == 200, reply.text
                assert reply.json()[COORDS_FIELD]["disposition"] == "staged"
                again = padded(w.client.request_body({"messages": USER}, w.client.admit("r-http2")), LIMIT)

                async def stream() -> AsyncIterator[bytes]:
                    for i in range(0, len(again), 4096):
                        yield again[i : i + 4096]

                streamed = await http.post("/v1/chat/completions", content=stream(), headers=json_type)
                assert streamed.status_code == 200, streamed.text
                assert streamed.json()[COORDS_FIELD]["disposition"] == "staged"
            assert len(w.engine.prompts) == 2 and w.captured() == (2, 2)

    asyncio.run(go())
    fault_report.record(
        SECTION,
        "oversized HTTP body",
        injected=2,
        survived=2,
        outcome="413 request_too_large naming the limit, before the body is read (content-length, chunked)",
    )


def test_malformed_requests_get_400_naming_the_field_and_capture_nothing(
    tiny: tuple[Path, ChatRenderer], fault_report: Any
) -> None:
    async def go() -> int:
        async with worker_serving(tiny) as w, httpx.AsyncClient(base_url=w.server.url, timeout=30) as http:
            first = await http.post(
                "/v1/chat/completions",
                json=w.client.request_body({"messages": USER, "max_tokens": 2}, w.client.admit("r-cap")),
            )
            assert first.status_code == 200, first.text
            parent = w.client.coords_from_reply(first.json())
            assert parent is not None and parent.disposition == "staged"
            before = w.captured()
            follow_up = [
                *USER,
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And 4 * 5?"},
            ]
            good = w.client.admit("r-cap", parent).model_dump(mode="json")
            too_long = [f"r-cap/k{i}" for i in range(MAX_CHAIN_DEPTH)] + [parent.staging_key]
            broken: list[tuple[Any, str, str]] = [
                ({**good, "staging_chain": []}, "ng_capture.staging_chain", "empty list"),
                ({**good, "prev_len": -1}, "ng_capture.prev_len", "greater than or equal to 0"),
                ({**good, "rollout_id": "r/bad"}, "ng_capture.rollout_id", "pattern"),
                ({**good, "surprise": 1}, "ng_capture.surprise", "Extra inputs"),
                ({**good, "parent_chain_hash": None}, "ng_capture.parent_chain_hash", "token_in call needs"),
                ({**good, "staging_chain": ["other/c1"]}, "ng_capture.staging_chain", "is not of rollout"),
                (
                    {**good, "staging_chain": too_long},
                    "ng_capture.staging_chain",
                    f"at most {MAX_CHAIN_DEPTH - 1}",
                ),
                ("not an admission", "ng_capture", "valid dictionary"),
            ]
            for capture, param, words in broken:
                response = await http.post(
                    "/v1/chat/completions",
                    json={"messages": follow_up, "max_tokens": 2, "ng_capture": capture},
                )
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == param and words in error["message"], (param, error)
            for raw_body in [b'{"messages": [', b"\xff\xfe\x00"]:
                response = await http.post(
                    "/v1/chat/completions", content=raw_body, headers={"content-type": "application/json"}
                )
                assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
            assert w.captured() == before, "a refused request captured something"

            ok = await http.post(
                "/v1/chat/completions", json={"messages": follow_up, "max_tokens": 2, "ng_capture": good}
            )
            assert ok.status_code == 200, ok.text
            child = w.client.coords_from_reply(ok.json())
            assert child is not None and child.disposition == "staged" and child.prev_len == parent.cum_len
            return len(broken)

    count = asyncio.run(go())
    fault_report.record(
        SECTION,
        "malformed ng_capture",
        injected=count,
        survived=count,
        outcome="400 naming ng_capture.<field>; nothing captured; the next call is captured",
    )
    fault_report.record(
        SECTION, "malformed HTTP body", injected=2, survived=2, outcome="400 'body: not valid JSON'"
    )
