"""The ledger's /metrics on a real broker: lag per partition drains to 0, outcomes by reason."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.events import rollout_events
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerTuning
from pipeline.kafka.producer import KafkaEventSink
from pipeline.stagehost.metrics import StageMetrics
from pipeline.stagehost.runner import serve_stage
from pipeline.stagehost.server import MetricsServer
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.specs import LEDGER
from topics.records import Record, RolloutSeal

pytestmark = pytest.mark.broker

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(text: str) -> Samples:
    """Every sample of a /metrics page, keyed by name and label set."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def failed_rollout(rollout_id: str) -> list[Record]:
    """A one-call rollout the driver sealed as failed: its receipt is poisoned."""
    *calls, _ = rollout_events(rollout_id, 1)
    seal = RolloutSeal(rollout_id=rollout_id, status="failed", failure_reason="env_crashed", sealed_at=99.0)
    return [*calls, seal]


def test_ledger_metrics_show_lag_and_poisoned_receipts(
    kafka_config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    group = f"ledger-metrics-{uuid.uuid4().hex[:8]}"
    names = kafka_config.names
    events = [*rollout_events("ok-a", 3), *rollout_events("ok-b", 1), *failed_rollout("bad-a")]

    async def go() -> tuple[Samples, int, int]:
        await ensure_topics(kafka_config)
        async with KafkaEventSink(kafka_config) as producer:
            await producer.publish(events)
        metrics = StageMetrics("ledger")
        stop = asyncio.Event()
        async with KafkaEventSink(kafka_config) as kafka_sink:
            sink = metrics.sink(kafka_sink)
            ledger = LedgerStage(sink, LedgerConfig(seal_grace_s=30))
            with MetricsServer(metrics, port=0) as server:
                task = asyncio.create_task(
                    serve_stage(
                        ledger,
                        LEDGER,
                        kafka_config,
                        sink,
                        stop=stop,
                        group=group,
                        tuning=fast_group,
                        metrics=metrics,
                        lag_interval_s=0.2,
                    )
                )
                try:
                    async with httpx.AsyncClient(base_url=server.url, timeout=5) as http:
                        samples = await until_drained(http, group, names.partitions)
                        ready = (await http.get("/readyz")).status_code
                        live = (await http.get("/healthz")).status_code
                finally:
                    stop.set()
                    await task
        return samples, ready, live

    samples, ready, live = asyncio.run(go())
    assert (ready, live) == (200, 200)
    for topic in LEDGER.inputs(names):
        for partition in range(names.partitions):
            labels = {"group": group, "topic": topic, "partition": str(partition)}
            assert value(samples, "tokentrail_consumer_lag", **labels) == 0
    assert value(samples, "tokentrail_receipts_poisoned_total", stage="ledger", reason="rollout_failed") == 1
    assert value(samples, "tokentrail_receipts_total", stage="ledger") == 3
    assert value(samples, "tokentrail_open_rollouts", stage="ledger") == 0
    handled = sum(v for (name, _), v in samples.items() if name == "tokentrail_stage_events_in_total")
    assert handled == len(events)
    committed = value(
        samples, "tokentrail_stage_events_out_total", stage="ledger", event_type="call_committed"
    )
    assert committed == 5
    assert value(samples, "tokentrail_admission_to_staged_seconds_count", stage="ledger") == 5


async def until_drained(
    http: httpx.AsyncClient, group: str, partitions: int, within_s: float = 30
) -> Samples:
    """Scrape until every receipt is out and the group's lag reads 0 on every partition."""
    deadline = time.monotonic() + within_s
    while True:
        samples = scrape((await http.get("/metrics")).text)
        lags = [v for (name, labels), v in samples.items() if name == "tokentrail_consumer_lag"]
        done = value(samples, "tokentrail_receipts_total", stage="ledger") == 3
        if done and len(lags) == 2 * partitions and not any(lags):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained within {within_s}s: receipts done={done}, lag={lags}")
        await asyncio.sleep(0.2)
