"""Bad Kafka events, one test per case: where each ends up, naming which field or code,
and that the stages keep going.

"Nothing lost": every bad input ends up either on the dead-letter topic (naming the
field and the reason, with its raw bytes) or as the rejected outcome of its rollout (a
``FinalizedEvent`` whose reason is a failure code), and good rollouts published after
it are still accepted.

One run serves every broker case: the real ledger and finalizer (``serve_stage``,
in-process) on the session's tansu broker and a real in-process TransferQueue. Each
case (``badcases.CASES``) publishes its input under its own rollout id, built from real
captures (the capture core writing real rows); raw records go through a plain
``AIOKafkaProducer`` so that each lands at a known offset, and its dead letter is found
by that offset. Good rollouts on every partition follow all the bad input. The last
test is the producer side: an event too large to publish. The worker's HTTP limits are
in ``test_bad_http``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from badcases import CASES
from badinput import (
    SECTION,
    Case,
    Kit,
    Run,
    Sent,
    Watch,
    completed,
    good_rollout_ids,
    publish,
    stages_running,
)

from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.lag import LagReader
from pipeline.kafka.producer import KafkaEventSink
from topics import codec
from topics.codec import MAX_EVENT_BYTES, EventTooLarge
from topics.names import TopicNames
from topics.records import DeadLetter, ManifestEntry, RolloutReceipt

LETTER_GRACE_S = 5.0
RUN_DEADLINE_S = 90.0
GOOD_AFTER = 8  # good rollouts published after all the bad input

# ============================================================================ one run for all


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
                    # Letters a known gap never writes must not hold the run for long; a
                    # loaded machine can take a few seconds for the last recall letter.
                    if (
                        letters_wanted <= run.letters.keys()
                        or time.monotonic() - complete_at > LETTER_GRACE_S
                    ):
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
    """The receipt of a linear rollout of ``calls`` calls (about 250 bytes a call)."""
    entries = [
        ManifestEntry(
            call_id=f"c{i:05d}",
            parent_call_id=f"c{i - 1:05d}" if i else None,
            mode="token_in" if i else "text",
            prev_len=2 * i,
            delta_len=2,
            chain_hash="a" * 64,
            digest="c" * 64,
        )
        for i in range(calls)
    ]
    return RolloutReceipt(
        rollout_id=rollout_id,
        manifest=entries,
        failed_calls=[],
        terminal_call_id=entries[-1].call_id,
        terminal_selection="unique_leaf",
        terminal_cumulative_hash="b" * 64,
        capture_poisoned=False,
        sealed_at=3.0,
    )


@pytest.mark.broker
def test_an_event_too_large_to_publish_fails_naming_it_and_writes_nothing(
    kafka_config: KafkaConfig, fault_report: Any
) -> None:
    names = kafka_config.names
    huge = long_receipt("long-rollout", 20_000)  # a 20,000-turn rollout's receipt
    big = long_receipt("mid-rollout", 5_000)
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
