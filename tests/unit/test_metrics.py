"""Stage metrics without a broker: what the metered ports count, observe and serve."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

import httpx
import pytest
from rowkit import text_row

from bench.events import rollout_events
from pipeline.dataplane.timed import timed
from pipeline.stagehost.metrics import Health, StageMetrics
from pipeline.stagehost.server import MetricsServer
from pipeline.worker.metrics import render, worker_registry
from stages.capture.cache import ChainCache
from stages.capture.core import CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.vllm.scope import CaptureCounters
from stages.capture.vllm.worker import RequestCounters, VllmWorker
from stages.capture.writer import StagingWriter
from stages.finalize.janitor import JanitorConfig
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed
from topics.events import envelope
from topics.records import DeadLetter, Record, RolloutReceipt, RolloutSeal


def consumed(records: Sequence[Record], topic: str = "t") -> list[Consumed]:
    return [Consumed(topic, 0, offset, envelope(record)) for offset, record in enumerate(records)]


def sample(metrics: StageMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def failed_rollout(rollout_id: str) -> list[Record]:
    *calls, _ = rollout_events(rollout_id, 1)
    return [*calls, RolloutSeal(rollout_id=rollout_id, status="failed", failure_reason="x", sealed_at=9.0)]


async def through_ledger(metrics: StageMetrics, records: Sequence[Record]) -> RecordingSink:
    out = RecordingSink()
    ledger = LedgerStage(metrics.sink(out))
    await metrics.handler(ledger).handle(consumed(records))
    return out


def test_the_ledger_is_metered_by_its_ports() -> None:
    metrics = StageMetrics("ledger", process=False)
    records = [*rollout_events("ok", 2), *failed_rollout("bad"), *rollout_events("open", 1)[:1]]
    asyncio.run(through_ledger(metrics, records))

    assert sample(metrics, "tokentrail_stage_events_in_total", stage="ledger", event_type="admission") == 4
    assert sample(metrics, "tokentrail_stage_events_in_total", stage="ledger", event_type="seal") == 2
    assert sample(metrics, "tokentrail_stage_events_out_total", stage="ledger", event_type="receipt") == 2
    assert (
        sample(metrics, "tokentrail_stage_events_out_total", stage="ledger", event_type="call_committed") == 3
    )
    assert sample(metrics, "tokentrail_receipts_total", stage="ledger") == 2
    assert sample(metrics, "tokentrail_receipts_poisoned_total", stage="ledger", reason="rollout_failed") == 1
    assert sample(metrics, "tokentrail_open_rollouts", stage="ledger") == 1
    assert sample(metrics, "tokentrail_stage_batch_events_sum", stage="ledger") == len(records)
    # bench events are staged 0.5 s after admission
    assert sample(metrics, "tokentrail_admission_to_staged_seconds_sum", stage="ledger") == 1.5
    assert sample(metrics, "tokentrail_admission_to_staged_seconds_count", stage="ledger") == 3
    assert sample(metrics, "tokentrail_staged_to_committed_seconds_count", stage="ledger") == 3


def test_negative_intervals_count_as_skew_and_observe_zero() -> None:
    metrics = StageMetrics("ledger", process=False)
    records = rollout_events("r", 1)
    records[1] = records[1].model_copy(update={"staged_at": 0.25})  # staged "before" admitted_at 1.0
    asyncio.run(through_ledger(metrics, records))
    assert (
        sample(metrics, "tokentrail_latency_clock_skew_total", stage="ledger", interval="admission_to_staged")
        == 1
    )
    assert sample(metrics, "tokentrail_admission_to_staged_seconds_sum", stage="ledger") == 0
    assert sample(metrics, "tokentrail_admission_to_staged_seconds_bucket", stage="ledger", le="0.005") == 1


def test_the_finalizer_counts_outcomes_and_seal_to_finalized() -> None:
    async def go() -> StageMetrics:
        receipts = (
            await through_ledger(StageMetrics("ledger", process=False), failed_rollout("bad"))
        ).payloads(RolloutReceipt)
        metrics = StageMetrics("finalizer", process=False)
        finalizer = FinalizerStage(metrics.data_plane(MemoryDataPlane()), metrics.sink(RecordingSink()))
        await metrics.handler(finalizer).handle(consumed(receipts))
        await metrics.handler(finalizer).handle(consumed(receipts))  # a redelivery
        return metrics

    metrics = asyncio.run(go())
    labels = {"stage": "finalizer", "status": "rejected", "reason": "rollout_failed"}
    assert sample(metrics, "tokentrail_rollouts_finalized_total", **labels) == 1
    per_sample = {**labels, "policy": "terminal"}
    assert sample(metrics, "tokentrail_samples_finalized_total", **per_sample) == 1
    assert sample(metrics, "tokentrail_seal_to_finalized_seconds_count", stage="finalizer") == 1
    assert sample(metrics, "tokentrail_stage_duplicates_total", stage="finalizer") == 1
    deletes = {"stage": "finalizer", "op": "delete_calls", "outcome": "ok"}
    assert sample(metrics, "tokentrail_stage_dataplane_seconds_count", **deletes) == 1


def test_dead_letters_are_counted_by_source_topic() -> None:
    metrics = StageMetrics("ledger", process=False)
    letter = DeadLetter(
        source_topic="tt.admission",
        source_partition=0,
        source_offset=7,
        reason="bad",
        headers={},
        value_b64="",
        stage="ledger",
    )
    asyncio.run(metrics.sink(RecordingSink()).publish([letter]))
    assert sample(metrics, "tokentrail_dead_letters_total", stage="ledger", topic="tt.admission") == 1


def test_a_failed_publish_counts_nothing() -> None:
    metrics = StageMetrics("ledger", process=False)
    broken = RecordingSink()
    broken.broken = True
    with pytest.raises(ConnectionError):
        asyncio.run(metrics.sink(broken).publish(rollout_events("r", 1)[:1]))
    assert (
        sample(metrics, "tokentrail_stage_events_out_total", stage="ledger", event_type="admission") is None
    )


def test_timed_data_plane_reports_each_outcome() -> None:
    seen: list[tuple[str, str]] = []
    plane = MemoryDataPlane()
    wrapped = timed(timed(plane, lambda *_: None), lambda op, outcome, _: seen.append((op, outcome)))
    assert wrapped.inner is plane  # never wrapped twice

    async def go() -> None:
        await wrapped.list_keys("staging")
        with pytest.raises(Exception, match="no readable row"):
            await wrapped.get_calls(["r/c0"])
        plane.broken = True
        with pytest.raises(Exception, match="down"):
            await wrapped.delete_calls(["r/c0"])

    asyncio.run(go())
    assert seen == [("list_keys", "ok"), ("get_calls", "missing"), ("delete_calls", "error")]


def test_health_goes_stale_without_ticks() -> None:
    now = [100.0]
    health = Health(stall_after_s=10, clock=lambda: now[0])
    assert health.live and not health.ready
    health.set_ready(True)
    now[0] += 11
    assert not health.live and not health.ready
    health.beat()
    assert health.live and health.ready


def test_the_server_answers_metrics_and_probes() -> None:
    now = [0.0]
    metrics = StageMetrics("ledger", health=Health(stall_after_s=5, clock=lambda: now[0]))
    with MetricsServer(metrics, port=0) as server, httpx.Client(base_url=server.url, timeout=5) as http:
        page = http.get("/metrics")
        assert page.status_code == 200 and "process_resident_memory_bytes" in page.text
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").status_code == 503
        metrics.health.set_ready(True)
        assert http.get("/readyz").status_code == 200
        now[0] = 6.0
        assert http.get("/healthz").status_code == 503
        assert http.get("/nope").status_code == 404


def test_worker_registry_times_the_writer_and_resolver_data_plane() -> None:
    cache = ChainCache()
    plane = MemoryDataPlane()
    writer = StagingWriter(plane, RecordingSink(), worker_id="w")
    core = CaptureCore(PrefixResolver(plane, cache), writer, cache)
    worker = cast(
        VllmWorker,
        SimpleNamespace(
            core=core,
            requests=RequestCounters(),
            capture_counters=CaptureCounters(),
            client=SimpleNamespace(engine_errors=0),
            renderer=SimpleNamespace(family="llama3"),
            weight_version=0,
            paused=False,
        ),
    )
    first = worker_registry(worker, "w")
    registry = worker_registry(worker, "w")  # a second app: it times the calls, never both

    asyncio.run(core.writer.data_plane.put_calls([]))
    asyncio.run(core.resolver.data_plane.get_calls([]))
    for op in ("put_calls", "get_calls"):
        labels = {"worker": "w", "op": op, "outcome": "ok"}
        assert registry.get_sample_value("tokentrail_worker_dataplane_seconds_count", labels) == 1
        assert first.get_sample_value("tokentrail_worker_dataplane_seconds_count", labels) is None
    text = render(registry).decode()
    assert 'tokentrail_worker_writer_queue_capacity{worker="w"} 4096.0' in text
    assert "tokentrail_worker_writer_backlog" in text
    assert 'tokentrail_worker_splice_failures_total{family="llama3",worker="w"} 0.0' in text


def test_the_finalizer_exports_what_its_janitor_swept() -> None:
    async def go() -> StageMetrics:
        plane = MemoryDataPlane()
        receipts = (
            await through_ledger(StageMetrics("ledger", process=False), failed_rollout("gone"))
        ).payloads(RolloutReceipt)
        metrics = StageMetrics("finalizer", process=False)
        finalizer = FinalizerStage(plane, metrics.sink(RecordingSink()), janitor=JanitorConfig())
        await metrics.handler(finalizer).handle(consumed(receipts))
        await plane.put_calls([text_row("gone", "late")])  # written after the rollout was finalized
        await metrics.handler(finalizer).tick(1.0)
        return metrics

    metrics = asyncio.run(go())
    assert sample(metrics, "tokentrail_staging_rows_swept_total", stage="finalizer", why="finished") == 1
    assert sample(metrics, "tokentrail_staging_rows_swept_total", stage="finalizer", why="expired") == 0


def test_the_heap_gauge_follows_objects_held_not_resident_memory() -> None:
    metrics = StageMetrics("ledger")

    def blocks() -> float:
        value = sample(metrics, "tokentrail_python_allocated_blocks")
        assert value is not None
        return value

    before = blocks()
    held = [object() for _ in range(100_000)]
    while_held = blocks()
    del held
    after = blocks()
    assert while_held - before >= 95_000  # a scrape allocates a few blocks of its own
    assert while_held - after >= 95_000  # freed objects leave the gauge, whatever the RSS does
    pending = [sample(metrics, "tokentrail_python_gc_pending", generation=g) for g in "012"]
    assert all(value is not None and value >= 0 for value in pending)
