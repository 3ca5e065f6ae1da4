"""Pipeline throughput and finalize latency: ledger + finalizer on the embedded broker.

The stages are the real ones (``LedgerStage``, ``FinalizerStage``) on an embedded tansu
broker (memory engine) and the real TransferQueue, hosted two ways (``--modes``):

- ``inline``: served by ``pipeline.stagehost.runner.serve_stage`` as consumer-group
  members in this process, sharing its interpreter (``tokentrail run --stages inline``);
- ``processes``: each member a ``tokentrail stage`` child process attached to the data
  plane's address file (``bench.stage_processes``; ``tokentrail run``'s default), so the
  ledger and the finalizer each have an interpreter, and a core, of their own.

The rows are real (``bench.rollouts``): the finalizer fetches, verifies every digest and
chain hash, writes the samples and deletes the rows, as in production.

For each mode, number of stage instances (that many ledger and finalizer members in the
two groups, each with its own producer and data-plane client) and rollout length:

1. throughput: the rows are staged and a backlog of rollouts (admissions, staged
   events, seals) is published while the stages are held at a gate; the groups settle,
   the gate opens, and the clock runs until the last rollout is finalized
   (calls/s and rollouts/s);
2. latency: further rollouts are published at ``load`` × that throughput, each seal
   one pacing interval after its rollout's call events, with ``sealed_at`` set when it
   is published; seal-to-finalized latency is ``FinalizedEvent.finalized_at − sealed_at``,
   split at the receipt's log time into the ledger's decision (the log-time merge's
   margin and fetch waits) and the finalizer's hop and work.

Inline, all members share one interpreter: more instances measure partitioning and
batching overhead, not more CPU. Each result gives the CPU seconds every process spent
while the backlog was worked off (``cpu_s``: this process, with the data plane and the
publisher; the broker; in ``processes`` mode each member), to read against
``backlog.seconds``. The ledger's memory per open rollout is measured separately
(``bench.ledger_memory``).

    tokentrail bench pipeline [--quick] [--json] [--modes inline,processes] [--plot FILE.png]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from bench.command import Benchmark, Option, Quick, ints, names
from bench.common import (
    cdf,
    machine,
    percentiles,
    process_cpu_s,
    tree_cpu_s,
    versions,
)
from bench.planes import PLACEMENTS, Placement, open_plane
from bench.rollouts import Rollout, capture_rollouts
from bench.stage_probes import Finalized, FinalizedTap, Gated, receipt_times, settled
from stages.ports import SAMPLES_PARTITION, STAGING_PARTITION, DataPlane
from topics.records import Record

TARGET_CALLS_PER_S = 2_000  # DESIGN §9, through ledger + finalizer on one 2-core machine
TARGET_P99_MS = 250.0  # DESIGN §9, finalize latency after seal
MODES = ("inline", "processes")


def bench_groups() -> Any:
    """Group timings for members that share one busy event loop: heartbeats run on that
    loop, so a 1 s session (the tests' setting) expires whenever the loop is busy for a
    second, and each expiry is a rebalance in the middle of the measurement. The broker
    is the embedded memory one, so the merge margin is the run's on it."""
    from pipeline.kafka.consumer import ConsumerTuning
    from pipeline.kafka.embedded.broker import MEMORY_LOG_MARGIN_MS

    return ConsumerTuning(
        session_timeout_ms=6_000, heartbeat_interval_ms=1_000, idle_margin_ms=MEMORY_LOG_MARGIN_MS
    )


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """The sweep; ``calls`` is the throughput backlog, ``latency_calls`` the paced phase."""

    instances: tuple[int, ...] = (1, 2, 4)
    lengths: tuple[int, ...] = (4, 16, 64)
    calls: int = 4096
    latency_calls: int = 2048
    min_latency_rollouts: int = 50
    load: float = 0.5
    partitions: int = 4
    placement: Placement = "embedded"
    memory_rollouts: int = 1000
    quiet_s: float = 2.0
    modes: tuple[str, ...] = ("inline",)

    def __post_init__(self) -> None:
        if not self.modes or not set(self.modes) <= set(MODES):
            raise ValueError(f"modes: some of {MODES}, got {self.modes}")
        if "processes" in self.modes and self.placement == "memory":
            raise ValueError("modes: stage processes attach to TransferQueue, not to a memory data plane")

    def rollouts(self, length: int) -> tuple[int, int]:
        """Rollouts in the backlog and in the paced phase, for rollouts of ``length`` calls."""
        return max(1, self.calls // length), max(self.min_latency_rollouts, self.latency_calls // length)


DEFAULT = PipelineConfig()
QUICK = Quick(
    "one instance, lengths 4 and 16, small backlog",
    PipelineConfig(
        instances=(1,),
        lengths=(4, 16),
        calls=512,
        latency_calls=128,
        min_latency_rollouts=20,
        memory_rollouts=200,
    ),
)
OPTIONS = (
    Option("--instances", "stage instances per group (default 1,2,4)", ints),
    Option("--lengths", "calls per rollout (default 4,16,64)", ints),
    Option("--calls", f"calls in the throughput backlog (default {DEFAULT.calls})", int),
    Option("--latency-calls", f"calls in the paced latency phase (default {DEFAULT.latency_calls})", int),
    Option("--load", f"paced rate as a fraction of throughput (default {DEFAULT.load})", float),
    Option("--placement", "where TransferQueue runs (default embedded)", choices=PLACEMENTS),
    Option(
        "--modes",
        "how the stages are hosted: inline (members in this process), processes (tokentrail stage "
        "children, a core each), or both side by side: inline,processes (default inline)",
        names,
    ),
    Option("--plot", "write the seal-to-finalized latency CDFs to this PNG", for_run=True),
)


async def put_rows(plane: DataPlane, rollouts: Sequence[Rollout], batch: int = 64) -> None:
    rows = [row for rollout in rollouts for row in rollout.rows]
    for start in range(0, len(rows), batch):
        await plane.put_calls(rows[start : start + batch])


async def publish_all(sink: Any, events: Sequence[Record], *, chunk: int = 2000, lanes: int = 4) -> None:
    """Publish ``events`` in chunks over a few concurrent lanes (the producer batches them)."""
    chunks = [events[i : i + chunk] for i in range(0, len(events), chunk)]

    async def lane(index: int) -> None:
        for part in chunks[index::lanes]:
            await sink.publish(part)

    await asyncio.gather(*(lane(i) for i in range(lanes)))


class Hosting(Protocol):
    """The stage members of one configuration, however hosted: the gate and what they report."""

    async def settled(self) -> None: ...

    def hold(self) -> None: ...

    def release(self) -> None: ...

    def cpu_s(self) -> dict[str, float]: ...

    def duplicates(self) -> dict[str, int | None]: ...

    def revocations(self) -> int | None: ...


@dataclass(slots=True)
class Members:
    """The running in-process stage members of one configuration."""

    gate: asyncio.Event
    stop: asyncio.Event
    started: list[asyncio.Event]
    revoked: list[float]
    tasks: list[asyncio.Task[Any]]
    ledgers: list[Any]
    finalizers: list[Any]
    quiet_s: float = 2.0

    async def settled(self) -> None:
        await settled(self.started, self.revoked, quiet_s=self.quiet_s)

    def hold(self) -> None:
        """The gate is closed from the start."""

    def release(self) -> None:
        self.gate.set()

    def cpu_s(self) -> dict[str, float]:
        return {}

    def duplicates(self) -> dict[str, int | None]:
        return {
            "ledger": sum(ledger.gauges().duplicates for ledger in self.ledgers),
            "finalizer": sum(f.gauges().duplicates for f in self.finalizers),
        }

    def revocations(self) -> int | None:
        return len(self.revoked)


@contextlib.asynccontextmanager
async def members(
    kafka: Any,
    count: int,
    attach: Callable[[], Any],
    finalized: dict[str, Finalized],
    tag: str,
    quiet_s: float = 2.0,
) -> AsyncIterator[Members]:
    """``count`` ledger and ``count`` finalizer members, gated; stopped (and committed) on exit."""
    from pipeline.kafka.producer import KafkaEventSink
    from pipeline.stagehost.runner import serve_stage
    from stages.specs import FINALIZER, LEDGER

    running = Members(asyncio.Event(), asyncio.Event(), [], [], [], [], [], quiet_s)
    async with contextlib.AsyncExitStack() as stack:
        for index in range(count):
            for spec in (LEDGER, FINALIZER):
                sink = await stack.enter_async_context(KafkaEventSink(kafka))
                if spec is LEDGER:
                    stage = spec.build(sink)
                    running.ledgers.append(stage)
                else:
                    plane = await stack.enter_async_context(attach())
                    stage = spec.build(FinalizedTap(sink, finalized), plane)
                    running.finalizers.append(stage)
                started = asyncio.Event()
                running.started.append(started)
                gated = Gated(stage, running.gate, running.revoked)
                running.tasks.append(
                    asyncio.create_task(
                        serve_stage(
                            gated,
                            spec,
                            kafka,
                            sink,
                            stop=running.stop,
                            group=f"{spec.group}-{tag}",
                            tuning=bench_groups(),
                            started=started,
                        ),
                        name=f"bench-{spec.name}-{index}",
                    )
                )
        try:
            yield running
        finally:
            running.gate.set()
            running.stop.set()
            results = await asyncio.gather(*running.tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise RuntimeError(f"{len(errors)} stage member(s) failed") from errors[0]


async def wait_for(finalized: dict[str, Finalized], rollout_ids: Sequence[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(r not in finalized for r in rollout_ids):
        if time.monotonic() > deadline:
            missing = sum(r not in finalized for r in rollout_ids)
            raise TimeoutError(f"{missing} rollout(s) not finalized within {timeout_s:g}s")
        await asyncio.sleep(0.01)


async def paced(sink: Any, rollouts: Sequence[Rollout], per_s: float) -> dict[str, float]:
    """Publish rollouts at ``per_s``: each tick the next rollout's call events, then the
    previous rollout's seal stamped now. Returns each rollout's ``sealed_at``."""
    sealed: dict[str, float] = {}
    interval = 1.0 / per_s
    due = time.monotonic()
    previous: Rollout | None = None
    for rollout in [*rollouts, None]:
        batch: list[Record] = [] if rollout is None else list(rollout.events)
        if previous is not None:
            now = time.time()
            batch.append(previous.seal.model_copy(update={"sealed_at": now}))
            sealed[previous.rollout_id] = now
        await sink.publish(batch)
        previous = rollout
        due += interval
        await asyncio.sleep(max(0.0, due - time.monotonic()))
    return sealed


async def measure(
    broker: Any,
    seed_plane: DataPlane,
    attach: Callable[[], Any],
    config: PipelineConfig,
    mode: str,
    count: int,
    backlog: Sequence[Rollout],
    later: Sequence[Rollout],
) -> dict[str, Any]:
    """One configuration: throughput on the backlog, then latency at ``config.load``."""
    from pipeline.kafka.admin import ensure_topics
    from pipeline.kafka.producer import KafkaEventSink
    from topics.names import TopicNames

    tag = uuid.uuid4().hex[:8]
    kafka = broker.kafka_config(TopicNames(prefix=f"bench{tag}", partitions=config.partitions))
    await ensure_topics(kafka)
    await put_rows(seed_plane, [*backlog, *later])
    finalized: dict[str, Finalized] = {}
    length = backlog[0].calls
    async with (
        KafkaEventSink(kafka, linger_ms=20) as publisher,
        hosted(mode, kafka, count, seed_plane, attach, finalized, tag, config) as run,
    ):
        await run.settled()
        run.hold()
        held = time.monotonic()
        # Seals after every call event, as a driver seals only once its admissions are acknowledged.
        await publish_all(publisher, [e for r in backlog for e in r.events])
        await publish_all(publisher, [r.seal for r in backlog])
        held_s = time.monotonic() - held
        cpu_before = _cpu(run)
        start = time.time()
        run.release()
        await wait_for(finalized, [r.rollout_id for r in backlog], timeout_s=600)
        cpu_after = _cpu(run)
        seconds = max(finalized[r.rollout_id].acked_at for r in backlog) - start
        calls = sum(r.calls for r in backlog)
        rollouts_per_s = len(backlog) / seconds
        offered = config.load * rollouts_per_s
        sealed = await paced(publisher, later, offered)
        await wait_for(finalized, [r.rollout_id for r in later], timeout_s=600)
        duplicates = run.duplicates()
        rebalances = run.revocations()
    latencies = [(finalized[r].event.finalized_at - at) * 1e3 for r, at in sealed.items()]
    receipts = await receipt_times(kafka)
    deciding = [(receipts[r] - at) * 1e3 for r, at in sealed.items()]
    finalizing = [(finalized[r].event.finalized_at - receipts[r]) * 1e3 for r in sealed]
    statuses = Counter(
        f.event.status if f.event.status == "accepted" else str(f.event.rejection_reason)
        for f in finalized.values()
    )
    await clean_rows(seed_plane, [*backlog, *later])
    return {
        "mode": mode,
        "instances": count,
        "calls_per_rollout": length,
        "backlog": {
            "rollouts": len(backlog),
            "calls": calls,
            "seconds": round(seconds, 2),
            "calls_per_s": round(calls / seconds, 1),
            "rollouts_per_s": round(rollouts_per_s, 1),
        },
        "latency": {
            "rollouts": len(later),
            "offered_rollouts_per_s": round(offered, 1),
            "offered_calls_per_s": round(offered * length, 1),
            **{f"{k}_ms": round(v, 1) for k, v in percentiles(latencies, (50, 99)).items()},
            "max_ms": round(max(latencies), 1),
            "seal_to_receipt_ms": {k: round(v, 1) for k, v in percentiles(deciding, (50, 99)).items()},
            "receipt_to_finalized_ms": {k: round(v, 1) for k, v in percentiles(finalizing, (50, 99)).items()},
            "cdf_ms": [round(v, 2) for v in cdf(latencies)],
        },
        "finalized": dict(statuses),
        "duplicates": duplicates,
        "revocations": rebalances,
        "held_s": round(held_s, 2),
        "cpu_s": {name: round(cpu_after[name] - cpu_before[name], 2) for name in cpu_after},
    }


def _cpu(run: Hosting) -> dict[str, float]:
    """CPU seconds so far: this process (the data plane, the publisher, inline the stages),
    its other children (the broker; the guard's reaper idles) and each member process."""
    members = run.cpu_s()
    children = tree_cpu_s(os.getpid(), itself=False) - sum(members.values())
    return {"bench": process_cpu_s() or 0.0, "broker": children, **members}


@contextlib.asynccontextmanager
async def hosted(
    mode: str,
    kafka: Any,
    count: int,
    plane: DataPlane,
    attach: Callable[[], Any],
    finalized: dict[str, Finalized],
    tag: str,
    config: PipelineConfig,
) -> AsyncIterator[Hosting]:
    """The members of one configuration, in this process or as stage processes."""
    if mode == "inline":
        async with members(kafka, count, attach, finalized, tag, config.quiet_s) as running:
            yield running
        return
    from bench.stage_processes import process_members

    addresses = getattr(plane, "addresses", None)
    if addresses is None:
        raise ValueError(f"placement {config.placement}: stage processes need TransferQueue's addresses")
    async with process_members(
        kafka, count, addresses, finalized, tag, tuning=bench_groups(), quiet_s=config.quiet_s
    ) as running:
        yield running


async def clean_rows(plane: DataPlane, rollouts: Sequence[Rollout]) -> None:
    """Remove the samples and any rows left (untimed), so configurations start alike."""
    await plane.delete_samples([r.rollout_id for r in rollouts])
    left = await plane.list_keys(STAGING_PARTITION)
    if left:
        await plane.delete_calls(left)
    if await plane.list_keys(SAMPLES_PARTITION):
        await plane.delete_samples(await plane.list_keys(SAMPLES_PARTITION))


def attacher(plane: DataPlane) -> Callable[[], Any]:
    """A factory of data-plane clients for finalizer members: one TransferQueue client each
    (as separate processes would have), or the shared plane itself when it is in memory."""
    addresses = getattr(plane, "addresses", None)

    @contextlib.asynccontextmanager
    async def attach() -> AsyncIterator[DataPlane]:
        if addresses is None:
            yield plane
            return
        from pipeline.dataplane.transferqueue import TransferQueueDataPlane

        async with await TransferQueueDataPlane.attach(addresses, timeout_s=60.0) as client:
            yield client

    return attach


async def run_async(config: PipelineConfig) -> dict[str, Any]:
    from bench import ledger_memory
    from pipeline.kafka.embedded.broker import EmbeddedBroker
    from pipeline.process.heap import collect_per_batch

    collect_per_batch()  # this process hosts the data plane, as `tokentrail dataplane` does
    started = time.perf_counter()
    load_before = machine()["load_average"]
    fixtures: dict[int, tuple[list[Rollout], list[list[Rollout]]]] = {}
    for length in config.lengths:
        backlog_n, later_n = config.rollouts(length)
        made = await capture_rollouts(f"L{length}", backlog_n + later_n * len(config.instances), length)
        laters = [
            made[backlog_n + i * later_n : backlog_n + (i + 1) * later_n]
            for i in range(len(config.instances))
        ]
        fixtures[length] = (made[:backlog_n], laters)
    results: list[dict[str, Any]] = []
    if "processes" in config.modes:
        from pipeline.process.guard import guard_descendants

        guard_descendants()  # the stage processes die with this one, also on SIGKILL
    broker = EmbeddedBroker(storage="memory")
    await asyncio.to_thread(broker.start)
    try:
        async with open_plane(config.placement) as plane:
            for length in config.lengths:
                backlog, laters = fixtures[length]
                for count, later in zip(config.instances, laters, strict=True):
                    for mode in config.modes:  # side by side: the same rollouts, one after the other
                        results.append(
                            await measure(broker, plane, attacher(plane), config, mode, count, backlog, later)
                        )
    finally:
        await asyncio.to_thread(broker.stop)
    memory = [await ledger_memory.measure(config.memory_rollouts, n) for n in config.lengths]
    best = max(r["backlog"]["calls_per_s"] for r in results)
    worst_p99 = max(r["latency"]["p99_ms"] for r in results)
    by_mode = {
        mode: {
            "calls_per_s_best": max(r["backlog"]["calls_per_s"] for r in results if r["mode"] == mode),
            "finalize_p99_ms": max(r["latency"]["p99_ms"] for r in results if r["mode"] == mode),
            "pipeline_cpu_ms_per_call": min(cpu_ms_per_call(r) for r in results if r["mode"] == mode),
        }
        for mode in config.modes
    }
    return {
        "benchmark": "pipeline",
        "config": asdict(config),
        "machine": machine() | {"load_average_at_start": load_before},
        "versions": versions(),
        "results": results,
        "ledger_memory": memory,
        "summary": {
            "calls_per_s_best": best,
            "target_calls_per_s": TARGET_CALLS_PER_S,
            "calls_target_met": best >= TARGET_CALLS_PER_S,
            "finalize_p99_ms": worst_p99,
            "target_p99_ms": TARGET_P99_MS,
            "latency_target_met": worst_p99 < TARGET_P99_MS,
            "pipeline_cpu_ms_per_call": min(cpu_ms_per_call(r) for r in results),
            "by_mode": by_mode,
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


def cpu_ms_per_call(result: dict[str, Any]) -> float:
    """CPU of every process of the pipeline (stages, broker, data plane and publisher)
    while a backlog was worked off, per call of it."""
    seconds: float = sum(result["cpu_s"].values())
    calls: int = result["backlog"]["calls"]
    return round(seconds * 1000 / calls, 3)


def run(config: PipelineConfig | None = None, *, plot: Any = None) -> dict[str, Any]:
    """Run the sweep and return the report; ``plot`` (a path) also draws the latency CDFs."""
    report = asyncio.run(run_async(config or PipelineConfig()))
    if plot is not None:
        from bench.plots import latency_cdf

        report["plot"] = str(latency_cdf(report, plot))
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        "| mode | instances | calls/rollout | calls/s | rollouts/s | offered calls/s | seal→finalized p50 ms "
        "| p99 ms | p99 ms to receipt · after | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["results"]:
        b, lat = r["backlog"], r["latency"]
        cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in r["cpu_s"].items())
        lines.append(
            f"| {r['mode']} | {r['instances']} | {r['calls_per_rollout']} | {b['calls_per_s']:,.0f} | "
            f"{b['rollouts_per_s']:,.1f} | {lat['offered_calls_per_s']:,.0f} | {lat['p50_ms']:.0f} | "
            f"{lat['p99_ms']:.0f} | {lat['seal_to_receipt_ms']['p99']:.0f} · "
            f"{lat['receipt_to_finalized_ms']['p99']:.0f} | {cpu} |"
        )
    lines += ["", "| calls/rollout | bytes per open rollout | per open call | growth per finished rollout |"]
    lines.append("|---:|---:|---:|---:|")
    for m in report["ledger_memory"]:
        lines.append(
            f"| {m['calls_per_rollout']} | {m['bytes_per_open_rollout']:,} | {m['bytes_per_open_call']:,} | "
            f"{m['growth_bytes_per_finished_rollout']} |"
        )
    s = report["summary"]
    for mode, best in s["by_mode"].items():
        lines.append(
            f"{mode}: best {best['calls_per_s_best']:,.0f} calls/s, worst p99 {best['finalize_p99_ms']:.0f} ms, "
            f"{best['pipeline_cpu_ms_per_call']:.2f} CPU ms per call (all processes)"
        )
    lines.append(
        f"best {s['calls_per_s_best']:,.0f} calls/s (target {s['target_calls_per_s']:,}); "
        f"worst p99 {s['finalize_p99_ms']:.0f} ms (target < {s['target_p99_ms']:.0f})"
    )
    return "\n".join(lines)


BENCHMARK = Benchmark("pipeline", __doc__, DEFAULT, QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
