"""A restarted gateway's recovery, from its bookmark vs from the beginning of the log.

For each history size, an embedded tansu broker (memory engine) is filled with that many
events of sealed gateway rollouts (admissions carrying gateway logical ids, staged
events, seals: ``bench.events``), and a gateway's bookmark is committed at the log's end
(no session open). Then a tail of ``--open`` unsealed rollouts is published: the sessions
a restart must reopen. The restart is timed both ways, side by side on the same topics:
``recover`` from the committed bookmark (what ``tokentrail gateway`` does) and from
offset 0 (what it did before). Both must reopen the same sessions with the same calls,
or the run fails. From the bookmark the restart should stay flat as history grows. Last,
a replica that holds nothing takes one open rollout over (``take_over``), timed alone.

    tokentrail bench gateway-recovery [--quick] [--json] [--sizes 10000,100000,1000000] [--open 100]
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.command import Benchmark, Option, Quick, ints
from bench.common import per_size_on_a_memory_broker
from bench.events import rollout_events
from topics.records import CaptureAdmission, Record, RolloutSeal


@dataclass(frozen=True, slots=True)
class GatewayRecoveryConfig:
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    open: int = 100
    calls: int = 8
    partitions: int = 4


QUICK = Quick("2,000 events of history, 10 open rollouts", GatewayRecoveryConfig(sizes=(2_000,), open=10))
OPTIONS = (
    Option("--sizes", "events of history (default 10000,100000,1000000)", ints),
    Option("--open", "unsealed rollouts published after the bookmark (default 100)", int),
    Option("--calls", "calls per rollout (default 8)", int),
)


def gateway_rollouts(prefix: str, count: int, calls: int, *, sealed: bool) -> Iterator[list[Record]]:
    """``count`` rollouts as the gateway and a worker publish them, in chunks of ~5,000
    events: admissions with gateway logical ids, admitted now; the seal when ``sealed``."""
    now = time.time()
    batch: list[Record] = []
    for number in range(count):
        for event in rollout_events(f"{prefix}{number}", calls, group_id="g"):
            if isinstance(event, CaptureAdmission):
                logical = f"ht{event.prev_len + 1}-{number:016x}{event.prev_len:016x}"
                event = event.model_copy(update={"logical_call_id": logical, "admitted_at": now})
            elif isinstance(event, RolloutSeal) and not sealed:
                continue
            batch.append(event)
        if len(batch) >= 5_000:
            yield batch
            batch = []
    if batch:
        yield batch


async def publish(kafka: Any, chunks: Iterator[list[Record]]) -> int:
    from pipeline.kafka.producer import KafkaEventSink

    published = 0
    async with KafkaEventSink(kafka, linger_ms=20) as sink:
        for chunk in chunks:
            await sink.publish(chunk)
            published += len(chunk)
    return published


def fresh_sessions() -> Any:
    from pipeline.gateway.sessions import Sessions
    from stages.client import RolloutClient
    from stages.memory import RecordingSink

    return Sessions(RolloutClient(RecordingSink()), ttl_s=600.0)


async def timed_restart(kafka: Any, *, from_bookmark: bool) -> tuple[float, dict[str, list[str]]]:
    """A gateway's start: its bookmark read, then its sessions rebuilt; the seconds and
    each reopened session's call ids."""
    from pipeline.gateway.bookmark import Bookmark
    from pipeline.gateway.recovery import recover

    sessions = fresh_sessions()
    started = time.perf_counter()
    start = await Bookmark(kafka, sessions, replica=None, max_open_s=3600.0).start()
    await recover(kafka, sessions, start=start if from_bookmark else None, max_open_s=3600.0)
    seconds = time.perf_counter() - started
    reopened = [rollout_id for rollout_id, _ in sessions.floors(math.inf)]
    return seconds, {
        rollout_id: [c.call_id for c in sessions.get(rollout_id).calls] for rollout_id in reopened
    }


async def timed_takeover(kafka: Any, rollout_id: str) -> tuple[float, list[str]]:
    """A replica asked for a rollout it does not hold: the seconds to take it over, and its
    call ids."""
    from pipeline.gateway.bookmark import Bookmark
    from pipeline.gateway.recovery import take_over

    sessions = fresh_sessions()
    bookmark = Bookmark(kafka, sessions, replica="bench", max_open_s=3600.0)
    await bookmark.start()
    started = time.perf_counter()
    await take_over(kafka, sessions, bookmark, rollout_id)
    seconds = time.perf_counter() - started
    return seconds, [c.call_id for c in sessions.get(rollout_id).calls]


async def measure(broker: Any, size: int, config: GatewayRecoveryConfig) -> dict[str, Any]:
    from pipeline.gateway.bookmark import Bookmark
    from pipeline.kafka.admin import ensure_topics
    from topics.names import TopicNames

    kafka = broker.kafka_config(TopicNames(prefix=f"gw{size}", partitions=config.partitions))
    await ensure_topics(kafka)
    per_rollout = 2 * config.calls + 1
    history = await publish(
        kafka, gateway_rollouts("done", max(1, size // per_rollout), config.calls, sealed=True)
    )
    bookmark = Bookmark(kafka, fresh_sessions(), replica=None, max_open_s=3600.0)
    await bookmark.start()
    await bookmark.advance()  # the running gateway's commit: nothing open, the log's end
    tail = await publish(kafka, gateway_rollouts("open", config.open, config.calls, sealed=False))
    bookmark_s, from_bookmark = await timed_restart(kafka, from_bookmark=True)
    beginning_s, from_beginning = await timed_restart(kafka, from_bookmark=False)
    takeover_s, taken = await timed_takeover(kafka, "open0")
    if taken != from_bookmark["open0"]:
        raise RuntimeError(f"the takeover rebuilt calls {taken}, the restart {from_bookmark['open0']}")
    if from_bookmark != from_beginning or len(from_bookmark) != config.open:
        raise RuntimeError(
            f"the restart from the bookmark reopened {len(from_bookmark)} sessions, from the beginning "
            f"{len(from_beginning)}, of {config.open} open; or their calls differ"
        )
    return {
        "history_events": history,
        "tail_events": tail,
        "reopened": len(from_bookmark),
        "restart_from_bookmark_s": round(bookmark_s, 3),
        "restart_from_beginning_s": round(beginning_s, 3),
        "speedup": round(beginning_s / bookmark_s, 1),
        "takeover_s": round(takeover_s, 3),
    }


async def run_async(config: GatewayRecoveryConfig) -> dict[str, Any]:
    return await per_size_on_a_memory_broker(
        "gateway-recovery", config, lambda broker, size: measure(broker, size, config)
    )


def run(config: GatewayRecoveryConfig | None = None) -> dict[str, Any]:
    return asyncio.run(run_async(config or GatewayRecoveryConfig()))


def render(report: dict[str, Any]) -> str:
    lines = [
        "| history events | tail events | sessions reopened | restart from bookmark s | from the beginning s "
        "| speed-up | one rollout's takeover s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: Sequence[dict[str, Any]] = report["results"]
    for r in rows:
        lines.append(
            f"| {r['history_events']:,} | {r['tail_events']:,} | {r['reopened']} "
            f"| {r['restart_from_bookmark_s']:.3f} | {r['restart_from_beginning_s']:.3f} | {r['speedup']}x "
            f"| {r['takeover_s']:.3f} |"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("gateway-recovery", __doc__, GatewayRecoveryConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
