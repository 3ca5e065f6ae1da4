"""Prometheus metrics of the gateway, read from its counters at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.gateway.calls import Forwarder
from pipeline.gateway.pacing import AdmissionPacer
from pipeline.gateway.quotas import QuotaGuard
from pipeline.gateway.sessions import Sessions


class GatewayCollector(Collector):
    """Sessions open and abandoned, calls by lineage, worker failures and load, pacing."""

    def __init__(
        self, sessions: Sessions, forwarder: Forwarder, quotas: QuotaGuard, pacer: AdmissionPacer | None
    ) -> None:
        self.sessions = sessions
        self.forwarder = forwarder
        self.quotas = quotas
        self.pacer = pacer

    def collect(self) -> Iterator[Metric]:
        counters = self.forwarder.counters
        yield GaugeMetricFamily(
            "tokentrail_gateway_open_sessions", "rollout sessions not sealed yet", self.sessions.open_count
        )
        yield CounterMetricFamily(
            "tokentrail_gateway_abandoned_sessions",
            "sessions sealed failed after the session TTL",
            self.sessions.abandoned,
        )
        yield CounterMetricFamily(
            "tokentrail_gateway_taken_over",
            "rollouts this replica took over from the log: another gateway held them before",
            self.sessions.taken_over,
        )
        yield CounterMetricFamily(
            "tokentrail_gateway_handed_over",
            "idle sessions let go unsealed: the log showed another replica had taken them over",
            self.sessions.handed_over,
        )
        yield CounterMetricFamily(
            "tokentrail_gateway_rewritten_episodes",
            "terminal seals of sessions with several roots (the agent rewrote its history), which "
            "named the session's last call as the episode; the rewritten-away chains are no samples",
            self.sessions.rewritten_episodes,
        )
        calls = CounterMetricFamily(
            "tokentrail_gateway_calls", "agent calls, by their place in the tree", labels=["lineage"]
        )
        for lineage, value in (
            ("root", counters.roots),
            ("child", counters.children),
            ("retry", counters.retries),
        ):
            calls.add_metric([lineage], value)
        yield calls
        yield CounterMetricFamily(
            "tokentrail_gateway_template_kwargs_changes",
            "calls started as new roots because their chat_template_kwargs differ from the session's previous call's",
            counters.template_changes,
        )
        rewrites = CounterMetricFamily(
            "tokentrail_gateway_reasoning_rewrites",
            "children whose parent's reply the agent sent back with its reasoning rewritten (or left out, "
            "a reply of reasoning alone: reply_left_out), by kind",
            labels=["kind"],
        )
        for kind, value in sorted(counters.reasoning_rewrites.items()):
            rewrites.add_metric([kind], value)
        yield rewrites
        yield CounterMetricFamily(
            "tokentrail_gateway_worker_failures",
            "calls a worker failed before replying (retried)",
            counters.worker_failures,
        )
        in_flight = GaugeMetricFamily(
            "tokentrail_gateway_worker_in_flight", "calls in flight per worker", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "tokentrail_gateway_worker_healthy", "1 while a worker takes calls", labels=["worker"]
        )
        for url, flying, _, up in self.forwarder.workers.stats():
            in_flight.add_metric([url], flying)
            healthy.add_metric([url], int(up))
        yield in_flight
        yield healthy
        waits = CounterMetricFamily(
            "tokentrail_gateway_slot_waits",
            "calls that waited for a worker slot: over their session's fair share, or a full worker",
            labels=["worker"],
        )
        for url, waited in self.forwarder.workers.slot_waits():
            waits.add_metric([url], waited)
        yield waits
        capacity = GaugeMetricFamily(
            "tokentrail_gateway_worker_slots",
            "calls a worker runs at once, shared fairly among sessions: set by --worker-slots, or "
            "learned from its speed (then never fewer than the sessions that want it)",
            labels=["worker"],
        )
        for url, slots in self.forwarder.workers.capacities():
            capacity.add_metric([url], slots)
        yield capacity
        refused = CounterMetricFamily(
            "tokentrail_gateway_quota_refusals", "agent calls answered 429, by the limit", labels=["limit"]
        )
        for limit, value in sorted(self.quotas.refused.items()):
            refused.add_metric([limit], value)
        yield refused
        if self.pacer is not None:
            yield CounterMetricFamily(
                "tokentrail_gateway_paced",
                "POST /rollouts answered 429: the trainer's version too far behind the admissions",
                self.pacer.held,
            )
            yield GaugeMetricFamily(
                "tokentrail_gateway_policy_version",
                "the lowest weight version the workers reported last (-1: none yet)",
                -1 if self.pacer.version is None else self.pacer.version,
            )


def gateway_registry(
    sessions: Sessions, forwarder: Forwarder, quotas: QuotaGuard, pacer: AdmissionPacer | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(sessions, forwarder, quotas, pacer))
    return registry
