"""Prometheus metrics of one worker, read from its counters at scrape time.

A collector rather than incremented metric objects: the writer and the worker already
count everything, so scraping reads those numbers and nothing on the request path
pays for metrics. Each app gets its own registry, so several workers (or tests) in
one process never collide.

The one thing nobody counts is time spent in the data plane, so ``worker_registry``
wraps the data plane of the staging writer and of the prefix resolver in a timing
proxy (off the engine's path: both already run on the event loop, not in a hook).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.dataplane.timed import timed
from pipeline.stagehost.metrics import LATENCY_BUCKETS
from stages.capture.vllm.worker import VllmWorker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class WorkerCollector(Collector):
    """Captured and failed calls (by code), writer backlog, requests, weight version."""

    def __init__(self, worker: VllmWorker, worker_id: str) -> None:
        self.worker = worker
        self.worker_id = worker_id

    def collect(self) -> Iterator[Metric]:
        writer = self.worker.core.writer
        requests = self.worker.requests
        capture = self.worker.capture_counters
        labels = ["worker"]
        who = [self.worker_id]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(who, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(who, value)
            return family

        yield counter(
            "tokentrail_worker_requests", "generation requests received (every route)", requests.requests
        )
        yield counter(
            "tokentrail_worker_rejected_requests",
            "generation requests refused as invalid",
            requests.rejected_requests,
        )
        yield counter(
            "tokentrail_worker_engine_errors",
            "captured requests the engine failed while generating",
            self.worker.client.engine_errors,
        )
        yield counter(
            "tokentrail_worker_abandoned_calls",
            "admitted calls the engine never finished (error, disconnect, refusal), reported failed",
            capture.abandoned_calls,
        )
        yield counter(
            "tokentrail_worker_captured_calls", "calls staged with their row written", writer.stats.staged
        )
        failed = CounterMetricFamily(
            "tokentrail_worker_capture_failed_calls",
            "calls reported as capture_failed, by code",
            labels=["worker", "code"],
        )
        for code, count in sorted(writer.stats.failed.items()):
            failed.add_metric([self.worker_id, code], count)
        yield failed
        splice = CounterMetricFamily(
            "tokentrail_worker_splice_failures",
            "continuations whose exact prefix could not be spliced under the template (prefix_splice_failed)",
            labels=["worker", "family"],
        )
        splice.add_metric([self.worker_id, self.worker.renderer.family], capture.splice_failures)
        yield splice
        yield counter(
            "tokentrail_worker_history_segments",
            "continuations of a render-policy rollout whose render did not extend the parent (new roots)",
            capture.segments_started,
        )
        yield counter(
            "tokentrail_worker_refit_straddles",
            "captured calls whose tokens span weight versions",
            capture.refit_straddles,
        )
        yield counter(
            "tokentrail_worker_writer_queue_full", "rows the staging writer refused", writer.stats.queue_full
        )
        yield gauge("tokentrail_worker_writer_backlog", "calls waiting in the staging writer", writer.backlog)
        yield gauge(
            "tokentrail_worker_writer_queue_capacity",
            "rows the staging writer holds before it refuses more",
            writer.max_queue,
        )
        yield counter(
            "tokentrail_worker_writer_batches", "data-plane writes made by the writer", writer.stats.batches
        )
        yield gauge(
            "tokentrail_worker_chain_cache_bytes",
            "bytes held by the chain cache",
            self.worker.core.cache.nbytes,
        )
        yield gauge(
            "tokentrail_worker_weight_version",
            "weight version of newly admitted calls",
            self.worker.weight_version,
        )
        yield gauge(
            "tokentrail_worker_paused", "1 while generation is paused for a refit", int(self.worker.paused)
        )


def worker_registry(worker: VllmWorker, worker_id: str) -> CollectorRegistry:
    """The worker's registry; its writer and resolver are given timed data planes from here on
    (a later registry for the same worker takes the timing over, it is never doubled)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker, worker_id))
    seconds = Histogram(
        "tokentrail_worker_dataplane_seconds",
        "duration of data-plane calls by the staging writer and prefix resolver",
        ["worker", "op", "outcome"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )

    def observe(op: str, outcome: str, elapsed: float) -> None:
        seconds.labels(worker_id, op, outcome).observe(elapsed)

    core = worker.core
    core.writer.data_plane = timed(core.writer.data_plane, observe)
    core.resolver.data_plane = timed(core.resolver.data_plane, observe)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
