"""Restart cost with and without checkpoints: a rebuild at 10^4, 10^5 and 10^6 events of history.

For each history size, an embedded tansu broker (memory engine) is filled with that many
ledger input events (``bench.replay.fill``), and a first rebuild from checkpoints cuts a
checkpoint at the log's end (timed beside a plain rebuild of the same history: what
cutting costs). Then a fixed tail of new rollouts is published, and the restart is timed
both ways, side by side on the same topics: the rebuild that extends its ledger from the
checkpoint (checkpoint + tail, ``tokentrail replay --checkpoints``) and the rebuild from
offset 0. Both must give the same ledger (compared row for row), or the run fails. With
checkpoints the restart should stay flat as history grows; from offset 0 it grows with it.

    tokentrail bench checkpoint [--quick] [--json] [--sizes 10000,100000,1000000] [--tail 10000]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.command import Benchmark, Option, Quick, ints
from bench.common import per_size_on_a_memory_broker
from bench.replay import ReplayConfig, fill


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    tail: int = 10_000
    calls: int = 8
    partitions: int = 4


QUICK = Quick("10,000 events of history, a 2,000-event tail", CheckpointConfig(sizes=(10_000,), tail=2_000))
OPTIONS = (
    Option("--sizes", "events of history (default 10000,100000,1000000)", ints),
    Option("--tail", "events published after the checkpoint (default 10000)", int),
)


async def timed_plain(kafka: Any, out: Path) -> tuple[float, int]:
    from pipeline.replay.rebuild import rebuild
    from pipeline.replay.store import LedgerStore
    from stages.ledger.stage import LedgerConfig

    with LedgerStore(out) as store:
        start = time.perf_counter()
        result = await rebuild(kafka, store, ledger=LedgerConfig())
        return time.perf_counter() - start, result.events


async def timed_continued(kafka: Any, out: Path, directory: Path) -> tuple[float, Any]:
    from pipeline.replay.continued import rebuild_continued
    from stages.ledger.stage import LedgerConfig

    start = time.perf_counter()
    continued = await rebuild_continued(kafka, out, directory, ledger=LedgerConfig(), margin_s=0)
    return time.perf_counter() - start, continued


async def measure(broker: Any, size: int, config: CheckpointConfig) -> dict[str, Any]:
    from pipeline.replay.rebuild import compare
    from pipeline.replay.store import LedgerStore

    layout = ReplayConfig(calls=config.calls, partitions=config.partitions)
    kafka, history = await fill(broker, size, layout, f"ckpt{size}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain_first_s, _ = await timed_plain(kafka, work / "plain-first.sqlite")
        cutting_s, first = await timed_continued(kafka, work / "ledger.sqlite", work / "ckpt")
        checkpoint_bytes = sum(path.stat().st_size for path in (work / "ckpt").iterdir())
        _, tail = await fill(broker, config.tail, layout, f"ckpt{size}", rollouts="tail")
        restart_s, continued = await timed_continued(kafka, work / "ledger.sqlite", work / "ckpt")
        whole_s, whole_events = await timed_plain(kafka, work / "whole.sqlite")
        with LedgerStore(work / "ledger.sqlite") as a, LedgerStore(work / "whole.sqlite") as b:
            differences = compare(a, b)
    if differences or continued.result.events != tail or whole_events != history + tail:
        raise RuntimeError(
            f"checkpoint + tail differs from the whole log: {differences[:3]}, "
            f"read {continued.result.events} of a {tail}-event tail"
        )
    return {
        "history_events": history,
        "tail_events": tail,
        "first_rebuild_s": round(plain_first_s, 2),
        "first_rebuild_with_cut_s": round(cutting_s, 2),
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_bytes_per_event": round(checkpoint_bytes / max(1, first.result.events), 1),
        "restart_from_checkpoint_s": round(restart_s, 2),
        "restart_from_offset_0_s": round(whole_s, 2),
        "events_read_from_checkpoint": continued.result.events,
        "speedup": round(whole_s / restart_s, 1),
    }


async def run_async(config: CheckpointConfig) -> dict[str, Any]:
    from pipeline.process.heap import collect_per_batch

    collect_per_batch()  # as ``tokentrail replay`` does
    return await per_size_on_a_memory_broker(
        "checkpoint", config, lambda broker, size: measure(broker, size, config)
    )


def run(config: CheckpointConfig | None = None) -> dict[str, Any]:
    return asyncio.run(run_async(config or CheckpointConfig()))


def render(report: dict[str, Any]) -> str:
    lines = [
        "| history events | tail | restart from checkpoint s | from offset 0 s | speed-up "
        "| first rebuild s (with cut) | checkpoint bytes/event |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: Sequence[dict[str, Any]] = report["results"]
    for r in rows:
        lines.append(
            f"| {r['history_events']:,} | {r['tail_events']:,} | {r['restart_from_checkpoint_s']:.2f} "
            f"| {r['restart_from_offset_0_s']:.2f} | {r['speedup']}x "
            f"| {r['first_rebuild_s']:.2f} ({r['first_rebuild_with_cut_s']:.2f}) "
            f"| {r['checkpoint_bytes_per_event']} |"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("checkpoint", __doc__, CheckpointConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
