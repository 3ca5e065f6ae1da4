"""Seal to finalized, window by window: how long each rollout waited for its outcome, and
how many finished, in each stretch of a long run. A stall shows as a window whose p99
or count breaks from the others, where a whole-run figure would average it away.

The times are the events' own (their producers' clocks, one host): a seal's on the
admission topic, its rollout's finalized event's on the finalized topic, both read back
from the log once the run has drained.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.reader import assigned_reader, topic_ends
from topics.codec import HEADER_TYPE
from topics.events import EventType

WINDOW_S = 300.0
"""Five minutes: the stretch the soak's acceptance is judged on."""


def seal_to_finalized(
    config: KafkaConfig, began_at: float, window_s: float = WINDOW_S
) -> list[dict[str, Any]]:
    """One entry per ``window_s`` from ``began_at`` (seconds since the epoch), by seal time:
    rollouts sealed in it that were finalized, per second, and their p50/p99/max wait."""
    return asyncio.run(_windows(config, began_at, window_s))


async def _windows(config: KafkaConfig, began_at: float, window_s: float) -> list[dict[str, Any]]:
    sealed = await _first_times(config, config.names.admission, EventType.SEAL)
    finalized = await _first_times(config, config.names.finalized, EventType.FINALIZED)
    waits: dict[int, list[float]] = {}
    for rollout, sealed_ms in sealed.items():
        if rollout in finalized:
            window = max(0, int((sealed_ms / 1000 - began_at) // window_s))  # the warm-up's in the first
            waits.setdefault(window, []).append((finalized[rollout] - sealed_ms) / 1000)
    return [
        {
            "from_s": window * window_s,
            "finalized": len(times),
            "per_s": round(len(times) / window_s, 2),
            "p50_s": round(statistics.median(times), 3),
            "p99_s": round(_quantile(times, 0.99), 3),
            "max_s": round(max(times), 3),
        }
        for window, times in sorted(waits.items())
    ]


async def _first_times(config: KafkaConfig, topic: str, event_type: EventType) -> dict[str, int]:
    """The first ``event_type`` event's timestamp (ms) per key on ``topic``, whole log."""
    ends = {tp: end for tp, end in (await topic_ends(config, topic)).items() if end > 0}
    wanted = (HEADER_TYPE, event_type.value.encode())
    times: dict[str, int] = {}
    async with assigned_reader(config, dict.fromkeys(ends)) as consumer:
        pending = set(ends)
        while pending:
            for tp, records in (await consumer.getmany(*pending, timeout_ms=500)).items():
                for record in records:
                    if record.key is not None and wanted in list(record.headers):
                        times.setdefault(record.key.decode(errors="replace"), record.timestamp)
                if records and records[-1].offset + 1 >= ends[tp]:
                    pending.discard(tp)
    return times


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render(windows: list[dict[str, Any]]) -> list[str]:
    return [
        f"seal->finalized from {w['from_s']:>6.0f} s: {w['finalized']:>7} finalized ({w['per_s']}/s), "
        f"p50 {w['p50_s']} s, p99 {w['p99_s']} s, max {w['max_s']} s"
        for w in windows
    ]
