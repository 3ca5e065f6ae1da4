"""Ledger stage throughput (events/s, calls/s) in memory, and replay speed on the broker.

Run: ``python -m bench.ledger [--json] [--replay-events 10000 100000]``.
The in-memory figure isolates the stage's own logic; the replay figure includes the
embedded broker, decoding and the SQLite store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.events import rollout_events
from stages.ledger.stage import LedgerStage
from stages.memory import RecordingSink
from stages.ports import Consumed
from topics.events import envelope


async def stage_throughput(rollouts: int, calls: int, batch: int = 500) -> dict[str, Any]:
    items = [
        Consumed("in", 0, i, envelope(e))
        for i, e in enumerate(e for r in range(rollouts) for e in rollout_events(f"r{r}", calls))
    ]
    sink = RecordingSink()
    stage = LedgerStage(sink)
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        await stage.handle(items[i : i + batch])
        stage.committable({("in", 0): i + batch})
    elapsed = time.perf_counter() - start
    assert stage.stats.receipts == rollouts and not stage.open
    return {
        "rollouts": rollouts,
        "calls_per_rollout": calls,
        "events": len(items),
        "events_per_s": round(len(items) / elapsed),
        "calls_per_s": round(rollouts * calls / elapsed),
    }


async def replay_throughput(events_target: int, calls: int = 8) -> dict[str, Any]:
    from pipeline.kafka.broker import EmbeddedBroker
    from pipeline.kafka.log import KafkaEventSink, ensure_topics
    from pipeline.ledger_store import LedgerStore
    from pipeline.replay import rebuild
    from topics.names import TopicNames

    per_rollout = 2 * calls + 1
    rollouts = max(1, events_target // per_rollout)
    with EmbeddedBroker(storage="memory") as broker, tempfile.TemporaryDirectory() as tmp:
        config = broker.kafka_config(TopicNames(prefix="bench", partitions=4))
        await ensure_topics(config)
        async with KafkaEventSink(config, linger_ms=20) as sink:
            chunk: list[Any] = []
            for r in range(rollouts):
                chunk += rollout_events(f"r{r}", calls)
                if len(chunk) >= 5000:
                    await sink.publish(chunk)
                    chunk = []
            await sink.publish(chunk)
        with LedgerStore(Path(tmp) / "ledger.sqlite") as store:
            start = time.perf_counter()
            result = await rebuild(config, store)
            elapsed = time.perf_counter() - start
    return {
        "events": result.events,
        "seconds": round(elapsed, 2),
        "events_per_s": round(result.events / elapsed),
    }


def run(replay_sizes: tuple[int, ...] = (10_000, 100_000)) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        return {
            "benchmark": "ledger",
            "stage_in_memory": [await stage_throughput(2_000, calls) for calls in (4, 16, 64)],
            "replay": [await replay_throughput(n) for n in replay_sizes],
        }

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--replay-events", type=int, nargs="*", default=[10_000, 100_000])
    args = parser.parse_args()
    report = run(tuple(args.replay_events))
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
