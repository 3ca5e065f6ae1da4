"""The bad-input suite's machinery: the cases' vocabulary, real captures, the run's harness.

A case (``Case``) names its rollout, its row in the fault report and how to build its
input: records the capture core really wrote, and raw records (``Raw``) sent exactly
as given, each saying where it must end up (a ``Letter``: the dead letter of a stage
naming a field) or that it must be used like any good record. ``Kit`` makes the real
captures: the capture core writing real rows on the real data plane, its events kept
rather than published. The cases themselves are in ``badcases``; the run that serves
them all (``Run``, ``Watch``, ``stages_running``) is here, below. ``SECTION`` is the
fault report's section of both ``test_bad_events`` and ``test_bad_http``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.lag import LagReader
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.reader import assigned_reader
from pipeline.stagehost.runner import serve_stage
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.ledger.stage import LedgerConfig
from stages.memory import RecordingSink
from stages.specs import FINALIZER, LEDGER, STAGES, StageSettings
from topics import codec
from topics.codec import HEADER_EVENT_ID, HEADER_SCHEMA, HEADER_TYPE
from topics.names import TopicNames
from topics.records import (
    CallCoords,
    CaptureAdmission,
    CommitCoords,
    DeadLetter,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedEvent,
)

SECTION = "bad input"  # the fault report's section, for the broker and the HTTP cases
GRACE_S = 3.0  # the ledger's seal grace: a case whose input never settles waits this long

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
    coords: list[CommitCoords]
    """The worker's replies (with the chains the next admissions are built from)."""

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
        return (await self.serve(admission, turn))[0]

    async def serve(self, admission: CaptureAdmission, turn: int) -> tuple[StagedEvent, CommitCoords]:
        """One call served: its staged event, and the coords the worker replied with."""
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
            if isinstance(e.payload, StagedEvent) and e.payload.coords == coords.call_coords()
        ]
        assert isinstance(event, StagedEvent)
        return event, coords

    async def chain(self, rollout_id: str, turns: int = 2) -> Chain:
        admissions: list[CaptureAdmission] = []
        staged: list[StagedEvent] = []
        replies: list[CommitCoords] = []
        for turn in range(turns):
            admissions.append(self.client.admit(rollout_id, replies[-1] if replies else None))
            event, reply = await self.serve(admissions[-1], turn)
            staged.append(event)
            replies.append(reply)
        return Chain(rollout_id, admissions, staged, replies)

    def child(self, chain: Chain, **lie: Any) -> tuple[CaptureAdmission, CaptureAdmission]:
        """The truthful admission of the next call on ``chain``, and a valid one that lies."""
        truth = self.client.admit(chain.rollout_id, chain.coords[-1])
        return truth, CaptureAdmission.model_validate({**truth.model_dump(), **lie})


def believed(admission: CaptureAdmission, served: StagedEvent) -> StagedEvent:
    """The staged event of a worker that believed ``admission`` (coords agree with it)."""
    coords = {
        **served.coords.model_dump(),
        "parent_call_id": admission.parent_call_id,
        "mode": admission.mode,
        "prev_len": admission.prev_len,
        "cum_len": admission.prev_len + served.coords.delta_len,
    }
    return served.model_copy(update={"coords": CallCoords.model_validate(coords)})


def recoord(staged: StagedEvent, **fields: Any) -> StagedEvent:
    """``staged`` with its coords changed (still a valid record)."""
    coords = CallCoords.model_validate({**staged.coords.model_dump(), **fields})
    return staged.model_copy(update={"coords": coords})


# ========================================================================= the run's harness


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
    (each awaited, so the order in the log is this order). After a raw event the next one
    is sent in a later millisecond: the ledger merges its topics by log time and puts a
    staged event first among equal timestamps, so one stamped in a raw seal's millisecond
    would overtake it."""
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
        await asyncio.sleep(0.002)
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
