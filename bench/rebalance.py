"""Stage instances under load, and what a kill -9 or a rolling restart of them costs.

``instances`` ledger and ``instances`` finalizer processes (``tokentrail stage``, the
production command, as ``bench pipeline --modes processes`` starts them) share their
groups' partitions while rollouts are published at a steady rate. Per scenario, in a run
of its own on fresh topics: nothing happens (the baseline); one ledger member is killed
with SIGKILL a third of the way in and started again at once; the same for a finalizer
member; every member is restarted in turn (SIGTERM, start again, wait until it is ready,
the next one). Each rollout must come out finalized exactly once in outcome (copies of
the same event are counted, two different outcomes fail the run), and every rollout
must come out. The disruption is measured on the rollouts sealed around the fault: the
worst seal-to-finalized latency against the baseline's p99, and the longest time with
no rollout finalized while rollouts were due. The groups use aiokafka's range assignor
with its eager protocol: every rebalance stops every member of the group until the
join completes (aiokafka offers no cooperative protocol).

    tokentrail bench rebalance [--quick] [--json] [--instances 2] [--seconds 30] [--rate 40]
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from bench.command import Benchmark, Option, Quick
from bench.common import machine, percentiles, versions
from bench.rollouts import Rollout, capture_rollouts

SCENARIOS = ("baseline", "ledger killed", "finalizer killed", "rolling restart")


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    instances: int = 2
    seconds: float = 30.0
    rate: float = 40.0
    """Rollouts per second published (8 calls each)."""
    length: int = 8
    partitions: int = 8
    scenarios: tuple[str, ...] = SCENARIOS


QUICK = Quick("12 s per scenario at 20 rollouts/s", RebalanceConfig(seconds=12.0, rate=20.0))
OPTIONS = (
    Option("--instances", "ledger and finalizer processes each (default 2)", int),
    Option("--seconds", "publishing time per scenario (default 30)", float),
    Option("--rate", "rollouts published per second (default 40)", float),
)


class Members:
    """The stage processes of one run, by name, which a scenario may kill and start again."""

    def __init__(self, commands: dict[str, list[str]], log: IO[str]) -> None:
        from pipeline.stagehost.processes import StageProcess

        self.log = log
        self.children = {
            name: StageProcess(name, argv, env=os.environ, stderr=log) for name, argv in commands.items()
        }

    async def start(self, name: str) -> None:
        child = self.children[name]
        await child.start()
        if not await child.ready():
            raise RuntimeError(f"stage process {name} exited before it was ready")

    async def kill(self, name: str) -> None:
        os.kill(self.children[name].pid, signal.SIGKILL)
        await self.children[name].exited()

    async def restart(self, name: str) -> None:
        await self.children[name].stop(timeout_s=30.0)
        await self.start(name)

    async def stop_all(self) -> None:
        await asyncio.gather(*(child.stop(timeout_s=30.0) for child in self.children.values()))


@contextlib.asynccontextmanager
async def members(kafka: Any, addresses: Any, config: RebalanceConfig, tag: str) -> AsyncIterator[Members]:
    from bench.pipeline import bench_groups
    from bench.stage_processes import attached_plane
    from pipeline.stagehost.processes import StageOptions, stage_command
    from stages.ledger.stage import LedgerConfig
    from stages.specs import FINALIZER, LEDGER

    with tempfile.TemporaryDirectory(prefix="bench-rebalance-") as scratch:
        plane = attached_plane(addresses, Path(scratch))
        commands = {
            f"{spec.name}-{index}": stage_command(
                spec.name,
                kafka,
                StageOptions(LedgerConfig(), bench_groups(), data_plane=plane, group=f"{spec.group}-{tag}"),
            )
            for spec in (LEDGER, FINALIZER)
            for index in range(config.instances)
        }
        with (Path(scratch) / "stages.log").open("w") as log:
            running = Members(commands, log)
            try:
                await asyncio.gather(*(running.start(name) for name in commands))
                yield running
            finally:
                await running.stop_all()


async def disrupt(scenario: str, running: Members, after_s: float, spacing_s: float) -> list[float]:
    """Play ``scenario`` on the members; returns when each fault began (wall time)."""
    await asyncio.sleep(after_s)
    if scenario in ("ledger killed", "finalizer killed"):
        name = f"{scenario.split()[0]}-0"
        killed = time.time()
        await running.kill(name)
        await running.start(name)
        return [killed]
    if scenario == "rolling restart":
        began: list[float] = []
        for name in list(running.children):
            began.append(time.time())
            await running.restart(name)
            await asyncio.sleep(spacing_s)
        return began
    return []


async def run_scenario(
    broker: Any,
    plane: Any,
    config: RebalanceConfig,
    scenario: str,
    rollouts: Sequence[Rollout],
) -> dict[str, Any]:
    from bench.pipeline import clean_rows, paced, put_rows
    from bench.stage_processes import following_finalized
    from pipeline.kafka.admin import ensure_topics
    from pipeline.kafka.producer import KafkaEventSink
    from topics.names import TopicNames

    tag = uuid.uuid4().hex[:8]
    kafka = broker.kafka_config(TopicNames(prefix=f"rebal{tag}", partitions=config.partitions))
    await ensure_topics(kafka)
    await put_rows(plane, rollouts)
    seen: dict[str, list[tuple[str, float]]] = defaultdict(list)
    async with (
        KafkaEventSink(kafka) as publisher,
        members(kafka, plane.addresses, config, tag) as running,
        following_finalized(kafka, lambda event, event_id, at: seen[event.rollout_id].append((event_id, at))),
    ):
        await asyncio.sleep(2.0)  # the last join's rebalance passes
        faults = asyncio.create_task(disrupt(scenario, running, config.seconds / 3, spacing_s=2.0))
        sealed = await paced(publisher, rollouts, config.rate)
        began = await faults
        deadline = time.monotonic() + 120
        while any(r.rollout_id not in seen for r in rollouts) and time.monotonic() < deadline:  # noqa: ASYNC110 (filled by the follower)
            await asyncio.sleep(0.05)
    await clean_rows(plane, rollouts)
    return summarize(scenario, sealed, seen, began)


def summarize(
    scenario: str, sealed: dict[str, float], seen: dict[str, list[tuple[str, float]]], began: list[float]
) -> dict[str, Any]:
    """Exactly one outcome per rollout (or the run fails); latency, and the fault's cost."""
    missing = [r for r in sealed if r not in seen]
    forked = [r for r, copies in seen.items() if len({event_id for event_id, _ in copies}) > 1]
    if missing or forked:
        raise RuntimeError(
            f"{scenario}: {len(missing)} rollout(s) never finalized, {len(forked)} with two outcomes"
        )
    done = {r: min(at for _, at in seen[r]) for r in sealed}
    latency = {r: (done[r] - at) * 1e3 for r, at in sealed.items()}
    around = [latency[r] for r, at in sealed.items() if any(b - 1.0 <= at <= b + 10.0 for b in began)]
    moments = sorted(done.values())
    first, last = min(sealed.values()), max(sealed.values())
    gaps = [b - a for a, b in itertools.pairwise(moments) if first <= a <= last]
    return {
        "scenario": scenario,
        "rollouts": len(sealed),
        "copies": sum(len(copies) - 1 for copies in seen.values()),
        **{f"{k}_ms": round(v, 1) for k, v in percentiles(list(latency.values()), (50, 99)).items()},
        "max_ms": round(max(latency.values()), 1),
        "around_fault_max_ms": round(max(around), 1) if around else None,
        "longest_silence_ms": round(max(gaps, default=0.0) * 1e3, 1),
        "faults": len(began),
    }


async def run_async(config: RebalanceConfig) -> dict[str, Any]:
    from bench.planes import open_plane
    from pipeline.kafka.embedded.broker import EmbeddedBroker
    from pipeline.process.guard import guard_descendants
    from pipeline.process.heap import collect_per_batch

    collect_per_batch()  # this process hosts the data plane, as `tokentrail dataplane` does
    guard_descendants()  # the stage processes die with this one, also on SIGKILL
    started = time.perf_counter()
    count = int(config.seconds * config.rate)
    made = await capture_rollouts("rb", count * len(config.scenarios), config.length)
    broker = EmbeddedBroker(storage="memory")
    await asyncio.to_thread(broker.start)
    try:
        async with open_plane("embedded") as plane:
            results = [
                await run_scenario(broker, plane, config, scenario, made[i * count : (i + 1) * count])
                for i, scenario in enumerate(config.scenarios)
            ]
    finally:
        await asyncio.to_thread(broker.stop)
    baseline = next((r for r in results if r["scenario"] == "baseline"), None)
    return {
        "benchmark": "rebalance",
        "config": asdict(config),
        "machine": machine(),
        "versions": versions(),
        "results": results,
        "summary": {
            "baseline_p99_ms": baseline["p99_ms"] if baseline else None,
            "worst_around_fault_ms": max((r["around_fault_max_ms"] or 0.0) for r in results),
            "median_copies": statistics.median(r["copies"] for r in results),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(config: RebalanceConfig | None = None) -> dict[str, Any]:
    return asyncio.run(run_async(config or RebalanceConfig()))


def render(report: dict[str, Any]) -> str:
    lines = [
        "| scenario | rollouts | copies | p50 ms | p99 ms | max ms | max around the fault ms | longest silence ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        around = "-" if r["around_fault_max_ms"] is None else f"{r['around_fault_max_ms']:,.0f}"
        lines.append(
            f"| {r['scenario']} | {r['rollouts']} | {r['copies']} | {r['p50_ms']:,.0f} | {r['p99_ms']:,.0f} "
            f"| {r['max_ms']:,.0f} | {around} | {r['longest_silence_ms']:,.0f} |"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("rebalance", __doc__, RebalanceConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
