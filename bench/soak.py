"""Soak: the pipeline as separate processes under steady load for minutes or hours.

A stage that keeps anything per finished rollout grows without end in a long-lived
deployment, however slowly, so this watches what a sustained run costs over time
(``bench.cluster``: embedded broker, data plane, ledger, finalizer, a capture worker
with its driver, and the samples' owner: a trainer feed that takes and acknowledges
every sample, as a trainer would, unless ``--without-owner``; no gateway: the driver
calls the capture core directly). Every bound is set small (``--remember``,
``--closed-budget-mib``, the finalizer's retained samples, the worker's finalized
rollouts), so each is full within the first minute and any growth after that is a leak,
not a structure still filling.

Per process it samples resident memory and CPU time, and reports the memory's slope per
10,000 finished rollouts (least squares): over the samples past the first third, all of
them after the bounds filled, and over each half of the run apart (a process is flat
when its second half's slope is near 0 and below its first's). For the stages it also scrapes the interpreter's heap
(``tokentrail_python_allocated_blocks``) and full collections: resident memory that rises
while the blocks stay flat is the allocator keeping pages, not a leak. Then the stages' and
the owner's consumer lag over time (mean per third, max);
and what lies on disk per call: the log (the broker's data dir, with ``--storage
durable``; none in memory) and the finalizer's spool of sample copies. The ledger keeps
no store and this cluster runs no archive: both are reported as absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import windows
from bench.cluster import Cluster, events_on, group_lags, running
from bench.command import Benchmark, Option, Quick
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.process.guard import guard_descendants
from stages.finalize.retain import TRAINER_GROUP

SPOOL_DIR = "retained-samples"
"""Where ``tokentrail stage finalizer --data-dir D`` spools its sample copies (D/retained-samples)."""
OWNER_SETTLE_S = 60.0
"""After the drain, how long the owner may take to acknowledge the last (partial) groups."""
MAX_BOUND_FILL_ROLLOUTS = 1_000
"""The small bounds below are full by this many finished rollouts (the largest is the
closed rollouts': 0.125 MiB at ~330 accounted bytes each is ~400)."""


@dataclass(frozen=True, slots=True)
class SoakConfig:
    minutes: float = 30.0
    sample_every_s: float = 10.0
    storage: str = "memory"
    """The broker's storage: ``durable`` puts the log on disk (measured), at a lighter load."""
    concurrency: int = 6
    """Rollouts the worker plays at once."""
    fetch_wait_ms: int | None = None
    """The stages' ``--fetch-wait-ms`` (None: their default). tansu reads a partition's
    tail only as far as the fetch's wait allows, less the longer the log (DESIGN §3):
    a long soak on the embedded broker needs a longer wait."""
    remember: int = 300
    closed_budget_mib: float = 0.125
    retain_bytes: int = 512 * 1024
    without_owner: bool = False
    """No sample owner: nobody takes the samples, the data plane keeps every one."""

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.sample_every_s <= 0:
            raise ValueError("--minutes and --sample-every: must be > 0")
        if self.fetch_wait_ms is not None and self.fetch_wait_ms < 1:
            raise ValueError(f"--fetch-wait-ms: must be >= 1, got {self.fetch_wait_ms}")
        if self.storage not in ("memory", "durable"):
            raise ValueError(f"--storage: memory or durable, got {self.storage!r}")


DEFAULT = SoakConfig()
QUICK = Quick("a 2-minute soak, sampled every 5 s", SoakConfig(minutes=2.0, sample_every_s=5.0))
OPTIONS = (
    Option("--minutes", "how long the load runs (default 30)", float),
    Option("--sample-every", "seconds between samples (default 10)", float, field="sample_every_s"),
    Option("--storage", "the broker's storage (default memory)", choices=("memory", "durable")),
    Option("--concurrency", "rollouts the worker plays at once (default 6)", int),
    Option("--fetch-wait-ms", "the stages' fetch wait (default: theirs)", int),
    Option("--without-owner", "run no sample owner (the data plane keeps every sample)", switch=True),
)


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; one deleted while it is walked (the broker's store
    packs and expires batches as it runs) counts as gone."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(directory, name)).st_size
    return total


def _process_stats(pids: dict[str, int]) -> tuple[dict[str, float], dict[str, float]]:
    """Resident MiB and CPU seconds so far, per process."""
    rss, cpu = {}, {}
    for name, pid in pids.items():
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        rss[name] = round(proc.memory_info().rss / 2**20, 2)
        cpu[name] = round(times.user + times.system, 2)
    return rss, cpu


def _stage_state(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per stage, from its ``/metrics``: the interpreter's allocated blocks, its full
    (generation 2) collections, the rollouts it holds open (the ledger's) and the events
    it has handled (how far it has read, beside its commit point)."""
    state = {}
    for name, port in ports.items():
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue  # restarting: this sample goes without it
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
        values = {(sample.name, sample.labels.get("generation")): sample.value for sample in samples}
        state[name] = {
            "blocks": values[("tokentrail_python_allocated_blocks", None)],
            "full_collections": values[("python_gc_collections_total", "2")],
            "open_rollouts": values.get(("tokentrail_open_rollouts", None), 0.0),
            "events_in": sum(s.value for s in samples if s.name == "tokentrail_stage_events_in_total"),
        }
    return state


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs``; None with fewer than two distinct ``xs``."""
    if len(xs) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def _thirds(values: list[int]) -> list[float]:
    size = max(1, len(values) // 3)
    parts = [values[:size], values[size : 2 * size], values[2 * size :] or values[-1:]]
    return [round(sum(p) / len(p), 1) for p in parts]


def run(config: SoakConfig) -> dict[str, Any]:
    guard_descendants()  # the cluster's processes die with this one, also on SIGTERM or SIGKILL
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        return _run(config, Path(tmp))


def _run(config: SoakConfig, root: Path) -> dict[str, Any]:
    cluster = Cluster(
        root,
        seed=7,
        storage=config.storage,
        concurrency=config.concurrency,
        fetch_wait_ms=config.fetch_wait_ms,
        remember=config.remember,
        retain_bytes=config.retain_bytes,
        closed_budget_mib=config.closed_budget_mib,
        sample_owner=not config.without_owner,
    )
    samples: list[dict[str, Any]] = []
    with running(cluster):
        began, began_at = time.monotonic(), time.time()
        while time.monotonic() - began < config.minutes * 60:
            cluster.supervise(config.sample_every_s)
            pids = {name: proc.pid for name, proc in cluster.procs.items()} | {"broker": cluster.broker.pid}
            if cluster.broker.bucket_pid is not None:  # durable: the broker's object store is a process too
                pids["store"] = cluster.broker.bucket_pid
            rss, cpu = _process_stats(pids)
            finished = events_on(cluster.kafka, cluster.names.finalized)
            samples.append(
                {
                    "at_s": round(time.monotonic() - began, 1),
                    "finished": finished,
                    "calls": events_on(cluster.kafka, cluster.names.committed) - finished,
                    "lag": _lags(cluster.kafka, owner=not config.without_owner),
                    "ledger_inputs": events_on(cluster.kafka, cluster.names.admission)
                    + events_on(cluster.kafka, cluster.names.staged),
                    "rss_mib": rss,
                    "cpu_s": cpu,
                    "heap": _stage_state(cluster.metrics_ports),
                    "log_bytes": _tree_bytes(root / "broker"),
                    "spool_bytes": _tree_bytes(root / SPOOL_DIR),
                }
            )
        restarts = {name: proc.restarts for name, proc in cluster.procs.items() if proc.restarts}
        try:
            cluster.drain()
            drain_error = None
        except TimeoutError as exc:  # a finding of the run, not a reason to lose its samples
            drain_error = str(exc)
        after_drain = _lags(cluster.kafka, owner=not config.without_owner)
        if after_drain.get("owner"):
            after_drain["owner"] = _owner_settled(cluster)
        log_tails = _log_tails(root / "logs") if drain_error else {}
        by_window = windows.seal_to_finalized(cluster.kafka, began_at)
    report = _report(config, samples, restarts, after_drain)
    return {**report, "seal_to_finalized": by_window, "drain_error": drain_error, "log_tails": log_tails}


def _lags(config: KafkaConfig, *, owner: bool) -> dict[str, int]:
    """Consumer lag of every stage and, when it runs, of the sample owner (the trainer
    feed's group on the finalized topic)."""
    lags = group_lags(config)
    return (lags | {"owner": asyncio.run(_owner_lag(config))}) if owner else lags


async def _owner_lag(config: KafkaConfig) -> int:
    async with LagReader(config) as reader:
        return total_lag(await reader.group_lag(TRAINER_GROUP, [config.names.finalized]))


def _owner_settled(cluster: Cluster) -> int:
    """The owner's lag once it took the last groups (a partial one waits for its timeout),
    or after ``OWNER_SETTLE_S``."""
    deadline = time.monotonic() + OWNER_SETTLE_S
    lag = asyncio.run(_owner_lag(cluster.kafka))
    while lag and time.monotonic() < deadline:
        cluster.supervise(2.0)
        lag = asyncio.run(_owner_lag(cluster.kafka))
    return lag


def _log_tails(logs: Path, lines: int = 30) -> dict[str, list[str]]:
    """The last lines of each process's log: what a run that did not settle leaves to read."""
    return {
        path.stem: path.read_text(errors="replace").splitlines()[-lines:]
        for path in sorted(logs.glob("*.log"))
    }


def _report(
    config: SoakConfig, samples: list[dict[str, Any]], restarts: dict[str, int], after_drain: dict[str, int]
) -> dict[str, Any]:
    last = samples[-1]
    steady = [s for s in samples[len(samples) // 3 :] if s["finished"] >= MAX_BOUND_FILL_ROLLOUTS]
    processes = {}
    for name in last["rss_mib"]:
        first = steady[0] if steady else samples[0]
        rollouts = last["finished"] - first["finished"]
        processes[name] = {
            **_heap_report(samples, steady, name),
            **rss_report(samples, steady, name),
            "cpu_ms_per_rollout": round(1000 * (last["cpu_s"][name] - first["cpu_s"][name]) / rollouts, 2)
            if rollouts > 0
            else None,
        }
    calls = last["calls"]
    lag = {
        stage: {
            "mean_by_third": _thirds([s["lag"][stage] for s in samples]),
            "max": max(s["lag"][stage] for s in samples),
            "after_drain": after_drain.get(stage),
        }
        for stage in last["lag"]
    }
    return {
        "benchmark": "soak",
        "config": asdict(config),
        "rollouts": last["finished"],
        "calls": calls,
        "rollouts_per_s": round(last["finished"] / last["at_s"], 1),
        "steady_from_rollouts": steady[0]["finished"] if steady else None,
        "processes": processes,
        "lag": lag,
        "disk_bytes_per_call": {
            "log": round(last["log_bytes"] / calls, 1) if config.storage == "durable" and calls else None,
            "spool": round(last["spool_bytes"] / calls, 1) if calls else None,
            "ledger_store": None,
            "archive": None,
        },
        "spool_bytes_max": max(s["spool_bytes"] for s in samples),
        "restarts": restarts,
        "samples": samples,
        "machine": {"cpus": psutil.cpu_count()},
    }


def rss_report(samples: list[dict[str, Any]], steady: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A process's resident MiB first, from the first of ``steady`` on, and last, and its slope
    per 10,000 finished rollouts over ``steady`` and over each half of ``samples``."""
    halves = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    return {
        "rss_mib_first": samples[0]["rss_mib"][name],
        "rss_mib_steady_from": (steady[0] if steady else samples[0])["rss_mib"][name],
        "rss_mib_last": samples[-1]["rss_mib"][name],
        "slope_mib_per_10k_rollouts": _rss_slope(steady, name),
        "slope_by_half_mib_per_10k_rollouts": [_rss_slope(half, name) for half in halves],
    }


RSS_COLUMNS = f"{'process':<12} {'RSS first':>10} {'steady':>8} {'last':>8} {'MiB/10k':>9} {'1st half':>9} {'2nd half':>9}"
"""The header of the rendered ``rss_report`` columns."""


def rss_row(name: str, process: dict[str, Any]) -> str:
    """One process's ``rss_report`` as a line under ``RSS_COLUMNS``."""
    first_half, second_half = process["slope_by_half_mib_per_10k_rollouts"]
    return (
        f"{name:<12} {process['rss_mib_first']:>10.1f} {process['rss_mib_steady_from']:>8.1f} "
        f"{process['rss_mib_last']:>8.1f} {_signed(process['slope_mib_per_10k_rollouts']):>9} "
        f"{_signed(first_half):>9} {_signed(second_half):>9}"
    )


def _rss_slope(samples: list[dict[str, Any]], name: str) -> float | None:
    """A process's resident MiB per 10,000 finished rollouts over ``samples``, least squares."""
    fitted = slope([s["finished"] for s in samples], [s["rss_mib"][name] for s in samples])
    return None if fitted is None else round(fitted * 10_000, 3)


def _heap_report(samples: list[dict[str, Any]], steady: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A stage's interpreter heap over the run: blocks first, last and their slope per
    10,000 rollouts over the steady samples, and the full collections it ran."""
    samples = [s for s in samples if name in s.get("heap", {})]
    steady = [s for s in steady if name in s.get("heap", {})]
    if not samples:
        return {}
    blocks = [s["heap"][name]["blocks"] for s in samples]
    fitted = (
        slope([s["finished"] for s in steady], [s["heap"][name]["blocks"] for s in steady])
        if steady
        else None
    )
    return {
        "blocks_first": blocks[0],
        "blocks_last": blocks[-1],
        "blocks_max": max(blocks),
        "blocks_slope_per_10k_rollouts": None if fitted is None else round(fitted * 10_000),
        "open_rollouts_by_third": _thirds([int(s["heap"][name]["open_rollouts"]) for s in samples]),
        "unread_by_third": _thirds([int(s["ledger_inputs"] - s["heap"][name]["events_in"]) for s in samples])
        if name == "ledger"
        else None,
        "full_collections": samples[-1]["heap"][name]["full_collections"]
        - samples[0]["heap"][name]["full_collections"],
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"soak {report['config']['minutes']:g} min ({report['config']['storage']} broker): "
        f"{report['rollouts']} rollouts, {report['calls']} calls, {report['rollouts_per_s']}/s; "
        f"slopes (MiB per 10k rollouts) over the samples from {report['steady_from_rollouts']} rollouts on, "
        "and over each half of the run",
        f"{RSS_COLUMNS} {'CPU ms/r':>9}",
    ]
    for name, p in report["processes"].items():
        lines.append(f"{rss_row(name, p)} {p['cpu_ms_per_rollout']!s:>9}")
    for name, p in report["processes"].items():
        if "blocks_first" in p:
            lines.append(
                f"heap {name}: blocks {p['blocks_first']:,.0f} -> {p['blocks_last']:,.0f} (max {p['blocks_max']:,.0f}), "
                f"{p['blocks_slope_per_10k_rollouts']} per 10k rollouts; {p['full_collections']:g} full collections; "
                f"open rollouts by third {p['open_rollouts_by_third']}"
                + (f"; unread by third {p['unread_by_third']}" if p["unread_by_third"] is not None else "")
            )
    lines += windows.render(report["seal_to_finalized"])
    for stage, lag in report["lag"].items():
        lines.append(
            f"lag {stage}: mean by third {lag['mean_by_third']}, max {lag['max']}, after drain {lag['after_drain']}"
        )
    disk = report["disk_bytes_per_call"]
    lines.append(
        f"disk bytes per call: log {disk['log']}, spool {disk['spool']} (max {report['spool_bytes_max']} B), "
        "ledger store none, archive none"
    )
    if report.get("drain_error"):
        lines.append(f"did not settle after the load: {report['drain_error']}")
    if report["restarts"]:
        lines.append(f"restarts: {report['restarts']}")
    return "\n".join(lines)


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


BENCHMARK = Benchmark("soak", __doc__, DEFAULT, QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
