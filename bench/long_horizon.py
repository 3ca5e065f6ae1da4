"""Long-horizon rollouts: how tokentrail's cost per call grows with a rollout's depth.

For each length, one rollout is a linear chain of that many token-in calls (each
continues its parent's exact ids with 16 new prompt tokens and 16 generated ones). It
goes through the real capture path (``RolloutClient`` admissions with client-minted call
ids, ``CaptureCore`` with its prefix resolver, chain cache and background writer, rows
built by ``staging_row``), then, on topics of its own, through an embedded tansu broker
(memory engine), the TransferQueue data plane and the real ledger and finalizer stages
under ``serve_stage``. Per length, divided by the rollout's calls:

- bytes of the admissions and staged events capture published, encoded as on the wire
  (key + value + headers);
- bytes of everything the ledger published to the committed topic for the rollout
  (call records and receipt), read back from the log (null where the receipt is
  missing: ``committed_bytes`` then holds what did get published);
- Python bytes a ledger holds for the rollout while it is open (every call event in, no
  seal), under ``tracemalloc`` as in ``bench.ledger_memory``, before the broker starts;

and the rollout's ``FinalizedEvent``, and whether the ledger rebuilt from the log equals
the live one (``tokentrail replay --check``). A length that fails (a call its capture
refuses, an event over the event bound, no ``FinalizedEvent`` within ``--timeout``) is
reported under ``errors``, and the run goes on with the next length.

Since event schema 4 only admissions carry the staging chain (one key per ancestor), so
their bytes per call grow with depth while staged events, call records and the receipt's
compact manifest stay the same size per call (DESIGN §4.6). The default lengths are 10,
100, 1,000 and 10,000 calls; ``--quick`` runs 10 and 100.

    tokentrail bench long-horizon [--quick] [--json] [--lengths 10,100,1000,10000]
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.command import Benchmark, Option, Quick, ints
from bench.common import machine, versions
from bench.pipeline import attacher, members, publish_all, put_rows
from bench.planes import PLACEMENTS, Placement, open_plane
from bench.rollouts import Rollout
from bench.stage_probes import Finalized
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.ledger.stage import LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed, DataPlane
from topics.codec import HEADER_TYPE, EventTooLarge, Headers, decode, encode_record, record_size
from topics.events import envelope
from topics.records import (
    CaptureAdmission,
    CommitCoords,
    FinalizedEvent,
    Record,
    RolloutSeal,
    StagedCall,
    StagedEvent,
)

if TYPE_CHECKING:
    from pipeline.kafka.config import KafkaConfig

LEDGER_BATCH = 500  # records per batch, as the consumer loop hands them to the ledger
SHOWN_DIFFERENCES = 10


@dataclass(frozen=True, slots=True)
class LongHorizonConfig:
    """Rollout lengths and the shape of every call; ``timeout_s`` bounds one length's
    trip through the stages (publishing to ``FinalizedEvent``)."""

    lengths: tuple[int, ...] = (10, 100, 1_000, 10_000)
    new_tokens: int = 16
    generated: int = 16
    partitions: int = 4
    placement: Placement = "embedded"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths: distinct call counts >= 1, got {self.lengths}")


DEFAULT = LongHorizonConfig()
QUICK = Quick("lengths 10 and 100 only", LongHorizonConfig(lengths=(10, 100)))
OPTIONS = (
    Option("--lengths", "calls per rollout (default 10,100,1000,10000)", ints),
    Option(
        "--timeout",
        f"seconds one rollout may take through the stages (default {DEFAULT.timeout_s:g})",
        float,
        field="timeout_s",
    ),
    Option("--placement", "where TransferQueue runs (default embedded)", choices=PLACEMENTS),
)


class CaptureRefused(RuntimeError):
    """A call of the chain came back ``capture_failed``: the chain cannot go deeper."""


@dataclass(frozen=True, slots=True)
class Capture:
    """What capture left of one rollout: its call events and rows, and its seal when every
    call was captured (otherwise ``error`` says where the chain stopped)."""

    rollout_id: str
    events: list[Record]
    rows: list[StagedCall]
    seal: RolloutSeal | None
    error: str | None

    @property
    def calls(self) -> int:
        return len(self.rows)

    def rollout(self) -> Rollout | None:
        return None if self.seal is None else Rollout(self.rollout_id, self.events, self.seal, self.rows)


@dataclass(slots=True)
class Passage:
    """What became of one rollout in the stages: its outcome, and what went wrong."""

    finalized: FinalizedEvent | None = None
    errors: list[str] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    """Encoded bytes of each event that could not be published, by event id."""

    def fail(self, where: str, exc: BaseException) -> None:
        self.errors.append(f"{where}: {brief(exc)}")
        if isinstance(exc, EventTooLarge):
            self.refused[exc.event_id] = exc.size


def brief(exc: BaseException, limit: int = 300) -> str:
    """An exception on one line, short enough for a report (validation errors are long)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"


async def capture_chain(rollout_id: str, length: int, config: LongHorizonConfig) -> Capture:
    """One rollout of ``length`` chained calls through the real capture path; a call that
    capture refuses ends the chain there, unsealed."""
    plane, sink = MemoryDataPlane(), RecordingSink()
    cache = ChainCache()
    writer = StagingWriter(plane, sink, worker_id="bench-long-horizon", batch_delay_s=0.0)
    core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
    client = RolloutClient(sink)
    seal: RolloutSeal | None = None
    error: str | None = None
    writer.start()
    try:
        await _chain(client, core, rollout_id, length, config)
        seal = await client.seal(rollout_id, reward=1.0)
    except (CaptureRefused, ValueError) as exc:  # ValueError: a record the contract refuses
        error = f"capture: {brief(exc)}"
    finally:
        await writer.stop()
    events: list[Record] = [
        e.payload for e in sink.events if isinstance(e.payload, CaptureAdmission | StagedEvent)
    ]
    return Capture(rollout_id, events, list(plane.calls.values()), seal, error)


async def _chain(
    client: RolloutClient, core: CaptureCore, rollout_id: str, length: int, config: LongHorizonConfig
) -> None:
    """Admit, serve and capture ``length`` calls, each continuing the exact ids before it."""
    rng = random.Random(length)
    ids: list[int] = []
    coords: CommitCoords | None = None
    for turn in range(length):
        admission = client.admit(rollout_id, coords)
        await client.publish_admission(admission)
        prompt = ids + [rng.randrange(3, 50_000) for _ in range(config.new_tokens)]
        output = [rng.randrange(3, 50_000) for _ in range(config.generated)]
        logprobs = [-rng.random() * 4 for _ in range(config.generated)]
        prepared = await core.prepare(admission)
        coords = core.complete(prepared, prompt, output, logprobs, weight_version=1).coords
        if coords.disposition != "staged":
            raise CaptureRefused(f"call {turn} ({coords.call_id}): {coords.failure_reason}")
        ids = prompt + output
        if turn % 64 == 63:
            await asyncio.sleep(0)  # let the writer keep up


@dataclass(slots=True)
class EventSizes:
    """Encoded bytes (key + value + headers, as on the log) per event type: the total,
    the count and the largest, which is what the event bound is about."""

    total: Counter[str] = field(default_factory=Counter)
    count: Counter[str] = field(default_factory=Counter)
    largest: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, size: int) -> None:
        self.total[kind] += size
        self.count[kind] += 1
        self.largest[kind] = max(self.largest.get(kind, 0), size)


def wire_sizes(events: Sequence[Record]) -> EventSizes:
    """The sizes ``events`` have on the log, encoded by the contract's codec."""
    sizes = EventSizes()
    for event in events:
        sizes.add(envelope(event).event_type.value, record_size(*encode_record(event)))
    return sizes


class _Discard:
    """The ledger's sink while its memory is measured: only the ledger's own state counts."""

    async def publish(self, records: Sequence[Record]) -> None:
        del records


async def ledger_open_bytes(events: Sequence[Record]) -> int:
    """Python bytes a ledger holds for one open rollout made of ``events`` (no seal). They
    are decoded inside the measured region, as the consumer loop decodes them, so the
    decoded events the ledger keeps are counted."""
    encoded = [encode_record(event) for event in events]
    stage = LedgerStage(_Discard())
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        await _feed(stage, encoded)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    if len(stage.open) != 1:
        raise RuntimeError(f"expected one open rollout in the ledger, found {len(stage.open)}")
    return held


async def _feed(stage: LedgerStage, encoded: Sequence[tuple[bytes, bytes, Headers]]) -> None:
    """Decode and hand the records to the ledger in consumer-sized batches."""
    for start in range(0, len(encoded), LEDGER_BATCH):
        chunk = encoded[start : start + LEDGER_BATCH]
        await stage.handle([Consumed("admission", 0, start + i, decode(*rec)) for i, rec in enumerate(chunk)])


async def topic_sizes(kafka: KafkaConfig, topic: str) -> EventSizes:
    """The sizes of the records on ``topic``, by their ``tt-type`` header, from the
    beginning of the log to today's high watermarks."""
    from pipeline.kafka.lag import LagReader
    from pipeline.kafka.reader import assigned_reader

    async with LagReader(kafka) as lag:
        partitions = await lag.partitions([topic])
        ends = {tp: marks.highwater for tp, marks in (await lag.watermarks(partitions)).items()}
    sizes = EventSizes()
    async with assigned_reader(kafka, dict.fromkeys(partitions)) as consumer:
        left = {tp for tp in partitions if await consumer.position(tp) < ends[tp]}
        while left:
            for tp, records in (await consumer.getmany(*left, timeout_ms=500)).items():
                for record in records:
                    if record.offset < ends[tp]:
                        kind = dict(record.headers).get(HEADER_TYPE, b"").decode()
                        sizes.add(kind, record_size(record.key, record.value, record.headers))
            left = {tp for tp in left if await consumer.position(tp) < ends[tp]}
    return sizes


async def replay_differences(kafka: KafkaConfig) -> list[str]:
    """``tokentrail replay --check``: the ledger rebuilt from the log against the live one."""
    from pipeline.replay.rebuild import compare, materialize, rebuild
    from pipeline.replay.store import LedgerStore

    with (
        tempfile.TemporaryDirectory() as tmp,
        LedgerStore(Path(tmp) / "rebuilt.sqlite") as rebuilt,
        LedgerStore(Path(tmp) / "live.sqlite") as live,
    ):
        await rebuild(kafka, rebuilt)
        await materialize(kafka, live)
        return compare(rebuilt, live)


async def through_stages(
    kafka: KafkaConfig, plane: DataPlane, rollout: Rollout, config: LongHorizonConfig
) -> Passage:
    """Stage the rows, publish the rollout as a driver does (call events, then the seal)
    and run one ledger and one finalizer until its ``FinalizedEvent``, a member's failure
    or the timeout."""
    from pipeline.kafka.admin import ensure_topics
    from pipeline.kafka.producer import KafkaEventSink

    await ensure_topics(kafka)
    await put_rows(plane, [rollout])
    finalized: dict[str, Finalized] = {}
    passage = Passage()
    tag = kafka.names.prefix
    try:
        async with (
            KafkaEventSink(kafka, linger_ms=20) as publisher,
            members(kafka, 1, attacher(plane), finalized, tag) as running,
        ):
            running.gate.set()
            try:
                async with asyncio.timeout(config.timeout_s):
                    await publish_all(publisher, rollout.events)
                    await publisher.publish([rollout.seal])
                    await _finalized_or_stopped(finalized, rollout.rollout_id, running.tasks)
            except EventTooLarge as exc:
                passage.fail("publish", exc)
            except TimeoutError:
                passage.errors.append(f"finalize: no FinalizedEvent within {config.timeout_s:g} s")
    except RuntimeError as exc:  # ``members`` raises this, from the first error, once all stopped
        passage.fail("stage", exc.__cause__ or exc)
    if rollout.rollout_id in finalized:
        passage.finalized = finalized[rollout.rollout_id].event
    return passage


async def _finalized_or_stopped(
    finalized: dict[str, Finalized], rollout_id: str, tasks: Sequence[asyncio.Task[Any]]
) -> None:
    """Until the rollout is finalized, or a stage member stopped (it failed: no outcome comes)."""
    while rollout_id not in finalized:
        if any(task.done() for task in tasks):
            return
        await asyncio.sleep(0.05)


def _per_call(total: float, calls: int) -> float | None:
    return round(total / calls, 1) if calls else None


@contextlib.contextmanager
def timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Record the block's wall time as ``seconds[phase]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = round(time.perf_counter() - started, 2)


async def before_broker(length: int, config: LongHorizonConfig) -> tuple[dict[str, Any], Rollout | None]:
    """Capture one rollout of ``length`` calls, measure its event bytes and the ledger's
    open bytes; returns the length's result and the rollout, if it was captured whole."""
    seconds: dict[str, float] = {}
    with timed(seconds, "capture"):
        capture = await capture_chain(f"long-{length}", length, config)
    held: int | None = None
    if capture.error is None:
        with timed(seconds, "ledger_memory"):
            held = await ledger_open_bytes(capture.events)
    inputs = wire_sizes(capture.events)
    result: dict[str, Any] = {
        "calls": length,
        "captured_calls": capture.calls,
        "bytes_per_call": {
            "admission": _per_call(inputs.total["admission"], capture.calls),
            "staged": _per_call(inputs.total["staged"], capture.calls),
            "committed": None,
        },
        "ledger_bytes_open": held,
        "ledger_bytes_per_open_call": None if held is None else _per_call(held, capture.calls),
        "committed_bytes": {},
        "committed_events": {},
        "largest_event_bytes": inputs.largest,
        "refused_event_bytes": {},
        "finalized": None,
        "replay_equal": None,
        "replay_differences": None,
        "replay_differences_shown": [],
        "errors": [] if capture.error is None else [capture.error],
        "seconds": seconds,
    }
    return result, capture.rollout()


async def on_broker(
    broker: Any, plane: DataPlane, rollout: Rollout, config: LongHorizonConfig, result: dict[str, Any]
) -> None:
    """Run one captured rollout through the stages on topics of its own, read back what the
    ledger published and check a rebuild of the ledger against it, into ``result``."""
    from topics.names import TopicNames

    kafka = broker.kafka_config(
        TopicNames(prefix=f"long{uuid.uuid4().hex[:8]}", partitions=config.partitions)
    )
    # The rollout's admissions reach the broker as one burst (1.4 GB at 10,000 calls, each
    # carrying its chain), far faster than any driver makes calls: requests queued behind
    # it must not expire, as they would at the default 30 s.
    kafka = replace(kafka, request_timeout_ms=int(config.timeout_s * 1000))
    with timed(result["seconds"], "stages"):
        passage = await through_stages(kafka, plane, rollout, config)
    with timed(result["seconds"], "read_back_and_replay"):
        sizes = await asyncio.wait_for(topic_sizes(kafka, kafka.names.committed), config.timeout_s)
        differences = await asyncio.wait_for(replay_differences(kafka), config.timeout_s)
    outcome = passage.finalized
    if "receipt" in sizes.count:  # without it, what the ledger managed to publish is a partial figure
        result["bytes_per_call"]["committed"] = _per_call(sum(sizes.total.values()), rollout.calls)
    result["errors"] += passage.errors
    result |= {
        "committed_bytes": dict(sizes.total),
        "committed_events": dict(sizes.count),
        "largest_event_bytes": result["largest_event_bytes"] | sizes.largest,
        "refused_event_bytes": passage.refused,
        "finalized": None if outcome is None else outcome.model_dump(mode="json"),
        "replay_equal": not differences,
        "replay_differences": len(differences),
        "replay_differences_shown": differences[:SHOWN_DIFFERENCES],
    }


async def run_async(config: LongHorizonConfig) -> dict[str, Any]:
    from pipeline.kafka.embedded.broker import EmbeddedBroker

    started = time.perf_counter()
    load_before = machine()["load_average"]
    results: list[dict[str, Any]] = []
    rollouts: dict[int, Rollout] = {}
    for length in config.lengths:
        result, rollout = await before_broker(length, config)
        results.append(result)
        if rollout is not None:
            rollouts[length] = rollout
    if rollouts:
        broker = EmbeddedBroker(storage="memory")
        await asyncio.to_thread(broker.start)
        try:
            async with open_plane(config.placement) as plane:
                for result in results:
                    if result["calls"] in rollouts:
                        await on_broker(broker, plane, rollouts[result["calls"]], config, result)
        finally:
            await asyncio.to_thread(broker.stop)
    return summarize(config, results) | {
        "machine": machine() | {"load_average_at_start": load_before},
        "versions": versions(),
        "seconds": round(time.perf_counter() - started, 1),
    }


def summarize(config: LongHorizonConfig, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report: per-length results, and the headline figures keyed by calls per rollout."""
    outcomes = [r["finalized"] for r in results if r["finalized"] is not None]
    reasons = Counter(o["rejection_reason"] for o in outcomes if o["status"] == "rejected")
    replayed = [r["replay_equal"] for r in results if r["replay_equal"] is not None]

    def keyed(pick: Any) -> dict[str, Any]:
        return {str(r["calls"]): pick(r) for r in results}

    return {
        "benchmark": "long-horizon",
        "config": asdict(config),
        "results": list(results),
        "admission_bytes_per_call": keyed(lambda r: r["bytes_per_call"]["admission"]),
        "staged_bytes_per_call": keyed(lambda r: r["bytes_per_call"]["staged"]),
        "committed_bytes_per_call": keyed(lambda r: r["bytes_per_call"]["committed"]),
        "ledger_bytes_per_open_call": keyed(lambda r: r["ledger_bytes_per_open_call"]),
        "accepted": sum(o["status"] == "accepted" for o in outcomes),
        "rejected": sum(o["status"] == "rejected" for o in outcomes),
        "rejection_reasons": dict(reasons),
        "replay_equal": bool(replayed) and all(replayed),
        "errors": {str(r["calls"]): r["errors"] for r in results if r["errors"]},
    }


def run(config: LongHorizonConfig | None = None) -> dict[str, Any]:
    """Run every length and return the report."""
    return asyncio.run(run_async(config or LongHorizonConfig()))


def render(report: dict[str, Any]) -> str:
    lines = [
        "| calls | captured | admission B/call | staged B/call | committed B/call | ledger B/open call "
        "| finalized | replay equal |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["results"]:
        b, outcome = r["bytes_per_call"], r["finalized"]
        lines.append(
            f"| {r['calls']:,} | {r['captured_calls']:,} | {_cell(b['admission'])} | {_cell(b['staged'])} "
            f"| {_cell(b['committed'])} | {_cell(r['ledger_bytes_per_open_call'])} "
            f"| {'-' if outcome is None else outcome['status']} | {_cell(r['replay_equal'])} |"
        )
    for calls, errors in report["errors"].items():
        lines += [f"{calls} calls: {error}" for error in errors]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if isinstance(value, float) else str(value)


BENCHMARK = Benchmark("long-horizon", __doc__, DEFAULT, QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
