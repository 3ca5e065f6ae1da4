"""Capture core and finalizer against the real broker and the real TransferQueue.

The same flows run in milliseconds on in-memory ports in tests/unit; here the rows
go through TransferQueue's ZMQ storage and the events through the tansu broker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from pipeline.dataplane import encoding as rows_codec
from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import read_log
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import RecordingSink
from stages.ports import Consumed, DataPlane
from topics import digest
from topics.events import envelope
from topics.records import (
    CaptureAdmission,
    CommitCoords,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedCall,
    StagedCallBody,
    StagedEvent,
)

pytestmark = [pytest.mark.broker, pytest.mark.dataplane]


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedDataPlane]:
    with EmbeddedDataPlane.start() as embedded:
        yield embedded


Body = Callable[[TransferQueueDataPlane, KafkaEventSink], Awaitable[Any]]


def with_ports(server: EmbeddedDataPlane, config: KafkaConfig, body: Body) -> Any:
    async def go() -> Any:
        await ensure_topics(config)
        async with (
            await TransferQueueDataPlane.attach(server.addresses, timeout_s=20.0) as plane,
            KafkaEventSink(config) as sink,
        ):
            return await body(plane, sink)

    return asyncio.run(go())


def worker(
    plane: DataPlane,
    sink: KafkaEventSink,
    *,
    wait_s: float = 2.0,
    policy: AckPolicy = AckPolicy.STAGED,
    start: bool = True,
) -> CaptureCore:
    cache = ChainCache()
    writer = StagingWriter(plane, sink, worker_id=f"w{id(cache)}", batch_delay_s=0.002)
    if start:
        writer.start()
    return CaptureCore(
        PrefixResolver(plane, cache, wait_s=wait_s, poll_s=0.02), writer, cache, ack_policy=policy
    )


async def events_on(config: KafkaConfig, topic: str) -> list[Record]:
    return [item.event.payload async for batch, _, _ in read_log(config, [topic]) for item in batch]


def test_three_turns_staged_rows_concatenate_to_engine_ids(
    server: EmbeddedDataPlane,
    kafka_config: KafkaConfig,
) -> None:
    async def body(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> None:
        core, client = worker(plane, sink), RolloutClient(sink)
        seen: list[int] = []
        coords: CommitCoords | None = None
        keys = []
        for turn in range(3):
            admission = client.admit("real-r1", coords)
            await client.publish_admission(admission)
            prompt = [*seen, 100 + turn, 101]
            coords = await core.complete(
                await core.prepare(admission), prompt, [7 + turn, 8], [-0.5, -0.25], weight_version=0
            ).final_coords()
            keys.append(coords.staging_key)
            seen = [*prompt, 7 + turn, 8]
        await core.writer.stop()
        rows = await plane.get_calls(keys)
        assert [t for k in keys for t in rows[k].token_ids_delta] == seen
        assert rows[keys[-1]].cumulative_hash == digest.cumulative_hash(seen)
        staged = [
            e for e in await events_on(kafka_config, kafka_config.names.staged) if isinstance(e, StagedEvent)
        ]
        assert sorted(e.coords.call_id for e in staged) == sorted(k.split("/")[1] for k in keys)

    with_ports(server, kafka_config, body)


def test_child_on_other_worker_waits_then_resolves_or_times_out(
    server: EmbeddedDataPlane, kafka_config: KafkaConfig
) -> None:
    async def body(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> None:
        client = RolloutClient(sink)
        first = worker(
            plane, sink, policy=AckPolicy.ENQUEUED, start=False
        )  # the parent's row waits in the queue
        parent = first.complete(
            await first.prepare(client.admit("real-r2")), [1, 2], [3], [-1.0], weight_version=0
        ).coords
        same_worker = await first.prepare(client.admit("real-r2", parent))
        assert same_worker.failure is None and same_worker.prefix_ids.tolist() == [1, 2, 3]
        impatient = worker(plane, sink, wait_s=0.3)
        failed = await impatient.prepare(client.admit("real-r2", parent))
        assert failed.failure is not None and failed.failure.code == "prefix_unavailable"
        patient = worker(plane, sink, wait_s=10.0)
        waiting = asyncio.create_task(patient.prepare(client.admit("real-r2", parent)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        first.writer.start()
        resolved = await waiting
        assert resolved.failure is None and resolved.prefix_ids.tolist() == [1, 2, 3]
        for core in (first, impatient, patient):
            await core.writer.stop()

    with_ports(server, kafka_config, body)


def test_tampered_parent_row_is_prefix_hash_mismatch(
    server: EmbeddedDataPlane, kafka_config: KafkaConfig
) -> None:
    async def body(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> None:
        client = RolloutClient(sink)
        first = worker(plane, sink)
        parent = await first.complete(
            await first.prepare(client.admit("real-r3")), [1, 2], [3], [-1.0], weight_version=0
        ).final_coords()
        row = (await plane.get_calls([parent.staging_key]))[parent.staging_key]
        await plane.put_calls([row.model_copy(update={"token_ids_delta": [1, 9, 3]})])
        other = worker(plane, sink)
        prepared = await other.prepare(client.admit("real-r3", parent))
        assert prepared.failure is not None and prepared.failure.code == "prefix_hash_mismatch"
        for core in (first, other):
            await core.writer.stop()

    with_ports(server, kafka_config, body)


def test_dead_data_plane_gives_failed_events_and_the_hook_returns_at_once(
    server: EmbeddedDataPlane, kafka_config: KafkaConfig
) -> None:
    async def body(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> None:
        doomed = EmbeddedDataPlane.start()
        async with await TransferQueueDataPlane.attach(doomed.addresses, timeout_s=1.0) as gone:
            doomed.stop()  # the data plane dies under an attached worker
            core = worker(gone, sink)
            prepared = await core.prepare(RolloutClient(sink).admit("real-r4"))
            started = time.perf_counter()
            completion = core.complete(prepared, [1, 2], [3], [-1.0], weight_version=0)
            hook_s = time.perf_counter() - started
            final = await completion.final_coords()
            await core.writer.stop()
        assert hook_s < 0.5  # no I/O in the hook: it cannot wait on the dead data plane
        assert final.disposition == "capture_failed"
        assert final.failure_reason in ("staging_write_failed", "staging_timeout")
        staged = [
            e for e in await events_on(kafka_config, kafka_config.names.staged) if isinstance(e, StagedEvent)
        ]
        assert [e.coords.failure_reason for e in staged] == [final.failure_reason]

    with_ports(server, kafka_config, body)


# ---------------------------------------------------------------- finalizer on real TransferQueue


async def capture_rollout(core: CaptureCore, client: RolloutClient, rollout_id: str) -> list[Record]:
    """Three turns with an abandoned retry on turn 2; returns the driver's and worker's events."""
    events: list[Record] = []
    coords: CommitCoords | None = None
    seen: list[int] = []
    for turn in range(3):
        admission = client.admit(rollout_id, coords, group_id="g")
        events.append(admission)
        prompt = [*seen, 100 + turn, 101]
        if turn == 1:
            retry = client.admit(rollout_id, coords, group_id="g")
            events.append(retry)
            c = await core.complete(
                await core.prepare(retry), prompt, [55], [-3.0], weight_version=0
            ).final_coords()
            events.append(StagedEvent(coords=c.call_coords(), worker_id="w", staged_at=1.0))
        coords = await core.complete(
            await core.prepare(admission),
            prompt,
            [10 * turn + 1, 10 * turn + 2],
            [-0.5, -0.125],
            weight_version=turn // 2,
        ).final_coords()
        events.append(StagedEvent(coords=coords.call_coords(), worker_id="w", staged_at=1.0))
        seen = [*prompt, 10 * turn + 1, 10 * turn + 2]
    return events


async def receipt_for(events: list[Record], rollout_id: str) -> RolloutReceipt:
    """The ledger's receipt for a sealed rollout (the ledger itself is tested on the broker elsewhere)."""
    out = RecordingSink()
    ledger = LedgerStage(out, LedgerConfig(seal_grace_s=0))
    seal = RolloutSeal(rollout_id=rollout_id, group_id="g", reward=1.0, status="completed", sealed_at=2.0)
    await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate([*events, seal])])
    return out.payloads(RolloutReceipt)[0]  # type: ignore[return-value]


def tamper(row: StagedCall, redigest: bool = False, **changes: Any) -> StagedCall:
    fields = {**row.model_dump(), **changes}
    if redigest:
        fields["digest"] = digest.digest_of_body(
            StagedCallBody.model_construct(**{k: v for k, v in fields.items() if k != "digest"})
        )
    return StagedCall.model_construct(**fields)


CORRUPTIONS: dict[str, Callable[[StagedCall], StagedCall | None]] = {
    "missing_row": lambda row: None,
    "flipped_token_id": lambda row: tamper(row, token_ids_delta=[*row.token_ids_delta[:-1], 999]),
    "changed_logprob": lambda row: tamper(row, logprobs_delta=[*row.logprobs_delta[:-1], -0.25]),
    "wrong_prev_len": lambda row: tamper(row, prev_len=row.prev_len + 1),
    "mask_not_zeros_then_ones": lambda row: tamper(row, token_mask_delta=[0.0, 1.0, 0.0, 1.0]),
    "row_from_other_rollout": lambda row: tamper(row, rollout_id="someone-else"),
}
EXPECTED = {
    "missing_row": "missing_row",
    "flipped_token_id": "digest_mismatch",
    "changed_logprob": "digest_mismatch",
    "wrong_prev_len": "length_mismatch",
    "mask_not_zeros_then_ones": "invalid_mask",
    "row_from_other_rollout": "row_identity_mismatch",
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_each_corruption_has_its_code(
    server: EmbeddedDataPlane, kafka_config: KafkaConfig, corruption: str
) -> None:
    rollout_id = f"real-{corruption.replace('_', '-')}"

    async def capture(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> list[Record]:
        core = worker(plane, sink)
        events = await capture_rollout(core, RolloutClient(sink), rollout_id)
        await core.writer.stop()
        key = [e for e in events if isinstance(e, CaptureAdmission)][1].staging_key  # turn 2, on the chain
        row = (await plane.get_calls([key]))[key]
        changed = CORRUPTIONS[corruption](row)
        await plane.delete_calls([key])
        if changed is not None:  # written under the original key, whatever the row says
            await plane.put_rows(
                "staging", [key], rows_codec.encode_calls([changed]), rows_codec.CALL_LAYOUTS[0]
            )
        return events

    events = with_ports(server, kafka_config, capture)
    receipt = asyncio.run(receipt_for(events, rollout_id))

    async def finalize(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> FinalizedEvent:
        await FinalizerStage(plane, sink).handle([Consumed("c", 0, 0, envelope(receipt))])
        finals = [
            e
            for e in await events_on(kafka_config, kafka_config.names.finalized)
            if isinstance(e, FinalizedEvent) and e.rollout_id == rollout_id
        ]
        assert len(finals) == 1
        assert not [k for k in await plane.list_keys("staging") if k.startswith(f"{rollout_id}/")]
        return finals[0]

    event = with_ports(server, kafka_config, finalize)
    assert event.status == "rejected" and event.rejection_reason == EXPECTED[corruption]


def test_mixed_versions_rejected_under_reject_policy(
    server: EmbeddedDataPlane, kafka_config: KafkaConfig
) -> None:
    from stages.finalize.verify import MixedVersionPolicy

    async def body(
        plane: TransferQueueDataPlane, sink: KafkaEventSink
    ) -> tuple[FinalizedEvent, FinalizedEvent]:
        core = worker(plane, sink)
        events = await capture_rollout(core, RolloutClient(sink), "real-mixed")
        await core.writer.stop()
        receipt = await receipt_for(events, "real-mixed")
        strict_out = RecordingSink()
        await FinalizerStage(plane, strict_out, policy=MixedVersionPolicy.REJECT).handle(
            [Consumed("c", 0, 0, envelope(receipt))]
        )
        return strict_out.payloads(FinalizedEvent)[0], receipt  # type: ignore[return-value]

    event, _ = with_ports(server, kafka_config, body)
    assert event.rejection_reason == "mixed_weight_versions"


class CrashAfterSample(KafkaEventSink):
    """A finalizer process that dies after writing the sample, before publishing."""

    async def publish(self, records: Any) -> None:
        raise SystemExit("killed")


def test_finalizer_killed_between_sample_and_event(
    server: EmbeddedDataPlane, kafka_config: KafkaConfig
) -> None:
    async def body(plane: TransferQueueDataPlane, sink: KafkaEventSink) -> None:
        core = worker(plane, sink)
        events = await capture_rollout(core, RolloutClient(sink), "real-crash")
        await core.writer.stop()
        receipt = await receipt_for(events, "real-crash")
        item = [Consumed("c", 0, 0, envelope(receipt))]
        crashing = CrashAfterSample(kafka_config)
        with pytest.raises(SystemExit):
            await FinalizerStage(plane, crashing).handle(item)
        assert "real-crash" in await plane.list_keys("samples")  # the sample was written
        await FinalizerStage(plane, sink).handle(item)  # the restarted finalizer replays the receipt
        finals = [
            e
            for e in await events_on(kafka_config, kafka_config.names.finalized)
            if isinstance(e, FinalizedEvent) and e.rollout_id == "real-crash"
        ]
        assert len(finals) == 1 and finals[0].status == "accepted"
        assert not [k for k in await plane.list_keys("staging") if k.startswith("real-crash/")]
        sample = (await plane.get_samples(["real-crash"]))["real-crash"]
        assert sample.token_mask == [0.0, 0.0, 1.0, 1.0] * 3

    with_ports(server, kafka_config, body)
