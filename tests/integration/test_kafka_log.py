"""The event log on a real (embedded tansu) broker: publish, consume, dead letters, lag."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from contractbroker import fast_groups_on

from pipeline.commands import lag as lag_command
from pipeline.kafka.admin import TopicLayoutError, ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop, ConsumerTuning
from pipeline.kafka.embedded.broker import free_port
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.kafka.producer import KafkaEventSink
from stages.ports import Consumed
from topics.codec import HEADER_EVENT_ID, HEADER_SCHEMA, HEADER_TYPE
from topics.events import EventType
from topics.names import TopicNames
from topics.records import CaptureAdmission, DeadLetter, FinalizedEvent, RolloutSeal

pytestmark = [pytest.mark.broker, pytest.mark.anyio]


def admission(rollout: str, index: int) -> CaptureAdmission:
    return CaptureAdmission(
        rollout_id=rollout, call_id=f"c{index:05d}", prev_len=0, mode="text", admitted_at=float(index)
    )


def admissions(rollouts: int, calls: int) -> list[CaptureAdmission]:
    """Calls interleaved across rollouts, in call order within each rollout."""
    return [admission(f"r{r}", c) for c in range(calls) for r in range(rollouts)]


def make_loop(
    config: KafkaConfig,
    sink: KafkaEventSink,
    handler: CollectingHandler,
    group: str,
    fast_group: ConsumerTuning,
    topics: Sequence[str] | None = None,
    max_records: int | None = None,
) -> ConsumerLoop:
    return ConsumerLoop(
        config,
        group_id=group,
        topics=topics or [config.names.admission],
        handler=handler,
        dead_letters=sink,
        stage="test",
        tuning=fast_group if max_records is None else replace(fast_group, max_records=max_records),
    )


@asynccontextmanager
async def running(loop: ConsumerLoop) -> AsyncIterator[asyncio.Task[None]]:
    """Run a loop in the background; stop it gracefully (and surface its errors) on exit."""
    task = asyncio.create_task(loop.run())
    try:
        yield task
    finally:
        loop.request_stop()
        await asyncio.wait_for(task, 20)


async def until(predicate: Any, what: str, within: float = 15.0) -> None:
    for _ in range(int(within / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def call_index(item: Consumed) -> int:
    payload = item.event.payload
    assert isinstance(payload, CaptureAdmission)
    return int(payload.call_id[1:])


async def test_topics_are_created_idempotently_with_one_partition_count(kafka_config: KafkaConfig) -> None:
    names = kafka_config.names
    assert sorted(await ensure_topics(kafka_config)) == sorted(names.all())
    assert await ensure_topics(kafka_config) == []
    async with LagReader(kafka_config) as reader:
        partitions = await reader.partitions(names.all())
    assert len(partitions) == len(names.all()) * names.partitions
    wrong = TopicNames(prefix=names.prefix, partitions=names.partitions + 1)
    with pytest.raises(TopicLayoutError, match="partitions"):
        await ensure_topics(replace(kafka_config, names=wrong))


async def test_events_are_routed_by_type_keyed_by_rollout_and_kept_in_order(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    names = kafka_config.names
    await ensure_topics(kafka_config)
    records = admissions(rollouts=8, calls=25)
    seals = [RolloutSeal(rollout_id=f"r{r}", status="completed", sealed_at=1.0) for r in range(8)]
    finals = [
        FinalizedEvent(
            rollout_id=f"r{r}",
            status="accepted",
            sample_key=f"r{r}",
            prompt_len=1,
            total_len=2,
            generated_tokens=1,
            call_count=1,
            finalized_at=2.0,
        )
        for r in range(8)
    ]
    handler = CollectingHandler()
    async with KafkaEventSink(kafka_config, linger_ms=20) as sink:
        for start in range(0, len(records), 40):  # several batched publishes
            await sink.publish(records[start : start + 40])
        await sink.publish([*seals, *finals])
        async with running(make_loop(kafka_config, sink, handler, f"{names.prefix}-g", fast_group)):
            consumed = await handler.wait_for(len(records) + len(seals))

    partitions_of: dict[str, set[int]] = defaultdict(set)
    per_rollout: dict[str, list[Consumed]] = defaultdict(list)
    for item in consumed:
        assert item.topic == names.admission
        assert item.event.key == item.event.payload.model_dump()["rollout_id"]
        partitions_of[item.event.key].add(item.partition)
        per_rollout[item.event.key].append(item)
    assert all(len(parts) == 1 for parts in partitions_of.values()), "a rollout spans partitions"
    assert len({next(iter(p)) for p in partitions_of.values()}) > 1, "keys did not spread over partitions"
    for rollout, items in per_rollout.items():
        calls = [call_index(i) for i in items if isinstance(i.event.payload, CaptureAdmission)]
        assert calls == list(range(25)), f"{rollout}: per-key order broken"
        assert isinstance(items[-1].event.payload, RolloutSeal), f"{rollout}: seal overtook admissions"
        offsets = [i.offset for i in items]
        assert offsets == sorted(offsets)
    assert len({(i.partition, i.offset) for i in consumed}) == len(consumed)

    async with LagReader(kafka_config) as reader:
        marks = await reader.watermarks(await reader.partitions([names.finalized, names.staged]))
    by_topic: dict[str, int] = defaultdict(int)
    for tp, mark in marks.items():
        by_topic[tp.topic] += mark.highwater
    assert by_topic == {names.finalized: len(finals), names.staged: 0}


async def test_two_consumers_in_a_group_split_partitions_and_see_every_record_once(
    either_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    kafka_config, fast_group = either_config, fast_groups_on(either_config)
    names = kafka_config.names
    await ensure_topics(kafka_config)
    group = f"{names.prefix}-g"
    first, second = CollectingHandler(), CollectingHandler()
    records = admissions(rollouts=40, calls=10)
    async with KafkaEventSink(kafka_config) as sink:
        loop_a = make_loop(kafka_config, sink, first, group, fast_group, max_records=50)
        loop_b = make_loop(kafka_config, sink, second, group, fast_group, max_records=50)
        async with running(loop_a), running(loop_b):
            await until(
                lambda: (
                    len(loop_a.assignment) == 2
                    and len(loop_b.assignment) == 2
                    and not loop_a.assignment & loop_b.assignment
                ),
                what="both members to own two partitions each",
            )
            await sink.publish(records[:200])
            await sink.publish(records[200:])
            await until(
                lambda: len(first.consumed) + len(second.consumed) >= len(records), what="all records"
            )
            await asyncio.sleep(0.3)  # anything extra (a duplicate) would show up now
            owned_a = {tp.partition for tp in loop_a.assignment}
            owned_b = {tp.partition for tp in loop_b.assignment}

    seen_a = {(i.partition, i.offset) for i in first.consumed}
    seen_b = {(i.partition, i.offset) for i in second.consumed}
    assert {p for p, _ in seen_a} <= owned_a and {p for p, _ in seen_b} <= owned_b
    assert seen_a and seen_b and not seen_a & seen_b
    assert len(first.consumed) + len(second.consumed) == len(records) == len(seen_a | seen_b)
    ids = [i.event.event_id for i in [*first.consumed, *second.consumed]]
    assert sorted(ids) == sorted(f"adm/{r.rollout_id}/{r.call_id}" for r in records)


async def test_a_restarted_consumer_resumes_at_its_committed_offset_without_gap(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    names = kafka_config.names
    await ensure_topics(kafka_config)
    group = f"{names.prefix}-g"
    records = admissions(rollouts=12, calls=50)
    async with KafkaEventSink(kafka_config) as sink:
        await sink.publish(records[:400])

        first_loop: ConsumerLoop | None = None

        async def stop_midway(batch: Sequence[Consumed]) -> None:
            if first_loop is not None and len(first.consumed) + len(batch) >= 150:
                first_loop.request_stop()

        first = CollectingHandler(on_batch=stop_midway)
        first_loop = make_loop(kafka_config, sink, first, group, fast_group, max_records=40)
        await asyncio.wait_for(first_loop.run(), 20)  # returns after its graceful stop
        committed = dict(first_loop.committed)
        assert 150 <= len(first.consumed) < 400

        await sink.publish(records[400:])  # more arrives while nobody consumes
        second = CollectingHandler()
        async with running(make_loop(kafka_config, sink, second, group, fast_group)):
            await second.wait_for(len(records) - len(first.consumed))
            await asyncio.sleep(0.3)

    firsts: dict[int, int] = {}
    for item in second.consumed:
        firsts.setdefault(item.partition, item.offset)
    for tp, offset in committed.items():
        if tp.partition in firsts:
            assert firsts[tp.partition] == offset, f"partition {tp.partition} did not resume at its commit"
    before = {(i.partition, i.offset) for i in first.consumed}
    after = {(i.partition, i.offset) for i in second.consumed}
    assert not before & after, "records were handled twice across a graceful restart"
    assert len(before | after) == len(records) == len(first.consumed) + len(second.consumed)
    per_partition: dict[int, list[int]] = defaultdict(list)
    for p, o in sorted(before | after):
        per_partition[p].append(o)
    for p, offsets in per_partition.items():
        assert offsets == list(range(len(offsets))), f"gap in partition {p}"


async def test_undecodable_records_go_to_the_dead_letter_topic_and_the_loop_keeps_going(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    names = kafka_config.names
    await ensure_topics(kafka_config)
    good_headers = [(HEADER_TYPE, b"admission"), (HEADER_SCHEMA, b"3"), (HEADER_EVENT_ID, b"adm/r1/c1")]
    bad = {
        "not-json": (b"\xffnot json", good_headers),
        "unknown-type": (b"{}", [(HEADER_TYPE, b"bogus"), (HEADER_SCHEMA, b"3")]),
        "old-schema": (b"{}", [(HEADER_TYPE, b"admission"), (HEADER_SCHEMA, b"2")]),
    }
    handler = CollectingHandler()
    letters = CollectingHandler()
    raw = AIOKafkaProducer(**kafka_config.client_kwargs(), acks="all")  # writes what ours never would
    await raw.start()
    async with KafkaEventSink(kafka_config) as sink:
        await sink.publish([admission("r1", 0)])
        sources: dict[tuple[int, int], tuple[str, bytes]] = {}
        try:
            for name, (value, headers) in bad.items():
                sent = await (await raw.send(names.admission, value=value, key=b"r1", headers=headers))
                sources[(sent.partition, sent.offset)] = (name, value)
        finally:
            await raw.stop()
        await sink.publish([admission("r1", 1)])
        stage_loop = make_loop(kafka_config, sink, handler, f"{names.prefix}-g", fast_group)
        dlq_loop = make_loop(
            kafka_config, sink, letters, f"{names.prefix}-dlq", fast_group, topics=[names.deadletter]
        )
        async with running(stage_loop), running(dlq_loop):
            await handler.wait_for(2)
            await letters.wait_for(len(bad))
        assert stage_loop.stats.dead_lettered == len(bad)

    assert [call_index(i) for i in handler.consumed] == [0, 1]
    found: dict[tuple[int, int], DeadLetter] = {}
    for item in letters.consumed:
        letter = item.event.payload
        assert isinstance(letter, DeadLetter)
        assert letter.source_topic == names.admission and letter.stage == "test"
        assert letter.reason and letter.key == "r1"
        found[(letter.source_partition, letter.source_offset)] = letter
    assert set(found) == set(sources)
    for where, (name, value) in sources.items():
        letter = found[where]
        assert base64.b64decode(letter.value_b64) == value, name
    by_name = {sources[w][0]: letter for w, letter in found.items()}
    assert by_name["not-json"].field == "value" and "JSON" in by_name["not-json"].reason
    assert by_name["unknown-type"].field == f"header {HEADER_TYPE}"
    assert "schema" in by_name["old-schema"].reason
    assert by_name["unknown-type"].headers[HEADER_TYPE] == "bogus"


async def test_a_loop_passes_by_the_types_it_does_not_read_without_decoding_them(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    """Only the types a stage reads are decoded (and so validated, and dead-lettered when
    bad); a record of another known type keeps its place and its offset is committed."""
    names = kafka_config.names
    await ensure_topics(kafka_config)
    seal = RolloutSeal(rollout_id="r1", status="completed", sealed_at=1.0)
    broken = [
        (b"\xffnot json", [(HEADER_TYPE, b"admission"), (HEADER_SCHEMA, b"4")]),  # a type not read
        (b"\xffnot json", [(HEADER_TYPE, b"seal"), (HEADER_SCHEMA, b"4")]),  # a type read
        (b"{}", [(HEADER_TYPE, b"bogus"), (HEADER_SCHEMA, b"4")]),  # no such type
    ]
    handler = CollectingHandler()
    raw = AIOKafkaProducer(**kafka_config.client_kwargs(), acks="all")
    await raw.start()
    async with KafkaEventSink(kafka_config) as sink:
        await sink.publish([admission("r1", 0), admission("r1", 1), seal])  # one topic, one partition
        try:
            for value, headers in broken:
                await (await raw.send(names.admission, value=value, key=b"r1", headers=headers))
        finally:
            await raw.stop()
        await sink.publish([admission("r1", 2), seal])
        loop = ConsumerLoop(
            kafka_config,
            group_id=f"{names.prefix}-g",
            topics=[names.admission],
            handler=handler,
            dead_letters=sink,
            stage="test",
            tuning=fast_group,
            reads=[EventType.SEAL],
        )
        async with running(loop):
            await handler.wait_for(2)
            await until(lambda: loop.stats.passed == 4 and sum(loop.committed.values()) == 8, "the commit")
        assert [item.event.event_type for item in handler.consumed] == [EventType.SEAL, EventType.SEAL]
        assert loop.stats.dead_lettered == 2  # the broken seal and the unknown type, not the admission
        assert loop.stats.passed == 4  # three admissions and the broken one


async def test_lag_is_exact_after_batched_produces(
    either_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    kafka_config, fast_group = either_config, fast_groups_on(either_config)
    names = kafka_config.names
    await ensure_topics(kafka_config)
    group = f"{names.prefix}-g"
    records = admissions(rollouts=50, calls=24)
    async with KafkaEventSink(kafka_config, linger_ms=20) as sink:
        # Concurrent publishes: the producer packs many records per batch.
        await asyncio.gather(*(sink.publish(records[i : i + 100]) for i in range(0, len(records), 100)))
        async with LagReader(kafka_config) as reader:
            before = await reader.group_lag(group, [names.admission])
            assert [row.committed for row in before] == [None] * names.partitions
            assert total_lag(before) == len(records)
            assert await reader.group_lag(group) == []  # no commits: the group is on no topic yet

            loop: ConsumerLoop | None = None

            async def stop_midway(batch: Sequence[Consumed]) -> None:
                if loop is not None and len(part.consumed) + len(batch) >= 500:
                    loop.request_stop()

            part = CollectingHandler(on_batch=stop_midway)
            loop = make_loop(kafka_config, sink, part, group, fast_group, max_records=60)
            await asyncio.wait_for(loop.run(), 20)
            middle = await reader.group_lag(group)
            assert total_lag(middle) == len(records) - len(part.consumed)
            assert {row.topic for row in middle} == {names.admission}
            assert sum(row.highwater for row in middle) == len(records)

            rest = CollectingHandler()
            async with running(make_loop(kafka_config, sink, rest, group, fast_group)):
                await rest.wait_for(len(records) - len(part.consumed))
            after = await reader.group_lag(group)
            assert total_lag(after) == 0
            per_partition: dict[int, int] = defaultdict(int)
            for item in [*part.consumed, *rest.consumed]:
                per_partition[item.partition] += 1
            assert {row.partition: row.highwater for row in after} == dict(per_partition)


async def test_lag_command_prints_one_json_document(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning, capsys: pytest.CaptureFixture[str]
) -> None:
    names = kafka_config.names
    await ensure_topics(kafka_config)
    group = f"{names.prefix}-g"
    async with KafkaEventSink(kafka_config) as sink:
        await sink.publish(admissions(rollouts=3, calls=4))
        loop: ConsumerLoop | None = None

        async def stop_now(batch: Sequence[Consumed]) -> None:
            assert loop is not None
            loop.request_stop()

        handled = CollectingHandler(on_batch=stop_now)
        loop = make_loop(kafka_config, sink, handled, group, fast_group, max_records=5)
        await asyncio.wait_for(loop.run(), 20)
    remaining = 12 - len(handled.consumed)
    assert remaining > 0

    parser = argparse.ArgumentParser()
    lag_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["lag", "--bootstrap", kafka_config.bootstrap, "--group", group, "--json"])
    assert await asyncio.to_thread(args.run, args) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["total_lag"] == remaining
    assert document["groups"] == {group: remaining}
    assert {row["group"] for row in document["partitions"]} == {group}
    assert sum(row["lag"] for row in document["partitions"]) == remaining
    assert document["broker"] == "up"


def test_lag_command_tells_a_broker_down_from_lag(capsys: pytest.CaptureFixture[str]) -> None:
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    parser = argparse.ArgumentParser()
    lag_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["lag", "--bootstrap", bootstrap, "--json"])
    assert args.run(args) == lag_command.EXIT_BROKER_DOWN
    out, err = capsys.readouterr()
    assert json.loads(out) | {"error": None} == {"bootstrap": bootstrap, "broker": "down", "error": None}
    assert f"broker down: cannot reach {bootstrap}" in err


class HoldingBack(CollectingHandler):
    """A stand-in for a stateful stage: it never lets a commit pass offset ``hold``."""

    def __init__(self, hold: int) -> None:
        super().__init__()
        self.hold = hold

    def committable(self, positions: Mapping[tuple[str, int], int]) -> Mapping[tuple[str, int], int]:
        return {tp: min(offset, self.hold) for tp, offset in positions.items()}


async def test_commits_follow_the_handler_and_a_failed_batch_is_never_committed(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    names = kafka_config.names
    await ensure_topics(kafka_config)
    records = admissions(rollouts=8, calls=10)
    async with KafkaEventSink(kafka_config) as sink:
        await sink.publish(records)
        holding = HoldingBack(hold=3)
        async with running(make_loop(kafka_config, sink, holding, f"{names.prefix}-held", fast_group)):
            await holding.wait_for(len(records))
        async with LagReader(kafka_config) as reader:
            held = await reader.group_lag(f"{names.prefix}-held")
            assert {row.committed for row in held if row.highwater} == {3}

            async def explode(batch: Sequence[Consumed]) -> None:
                raise RuntimeError("handler failed")

            failing = make_loop(
                kafka_config, sink, CollectingHandler(on_batch=explode), f"{names.prefix}-failing", fast_group
            )
            with pytest.raises(RuntimeError, match="handler failed"):
                await asyncio.wait_for(failing.run(), 20)
            rows = await reader.group_lag(f"{names.prefix}-failing", [names.admission])
            assert all(row.committed is None for row in rows)
            assert total_lag(rows) == len(records)
