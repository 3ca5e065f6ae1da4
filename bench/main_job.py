"""The main job on embedded defaults, memory vs durable broker storage, side by side.

Each trial is one ``tokentrail run --json`` process (broker, data plane, vLLM worker,
ledger and finalizer, end to end) in a fresh data directory, all serving one tiny model
made once up front. For every size the two storages alternate trial by trial, so a
change in the machine's load hits both. Per trial the report keeps the wall time of the
whole process, the driving time (``drive_s``: rollouts played, finalization excluded),
whether every rollout was accepted with lag 0, and the CPU seconds of each process of
the job (run, vLLM engine, tansu, the durable store's server), sampled while it runs:
that says where a difference comes from.

    tokentrail bench main-job [--quick] [--json] [--sizes 64,256] [--trials 1]

``summary.durable_over_memory`` is the median wall-time ratio at the largest size.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.command import Benchmark, Option, Quick, ints
from bench.common import machine, versions

STORAGES = ("memory", "durable")
TARGET_RATIO = 1.2
SAMPLE_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class MainJobConfig:
    sizes: tuple[int, ...] = (64, 256)
    trials: int = 1
    concurrency: int = 16
    run_args: tuple[str, ...] = ()
    """More ``tokentrail run`` flags, the same for both storages."""
    timeout_s: float = 1_800.0


def _words(text: str) -> tuple[str, ...]:
    """``--run-args '--partitions 1'`` → ``("--partitions", "1")``, split as a shell would."""
    return tuple(shlex.split(text))


QUICK = Quick("64 rollouts only", MainJobConfig(sizes=(64,)))
OPTIONS = (
    Option("--sizes", "rollouts per run (default 64,256)", ints),
    Option("--trials", "runs per size and storage (default 1)", int),
    Option("--concurrency", "rollouts in flight (default 16)", int),
    Option("--run-args", "more tokentrail run flags for both storages, e.g. '--partitions 1'", _words),
)


def process_role(command_line: Sequence[str], name: str) -> str:
    """Which part of the job a process is, from its name and command line (the job itself
    is the sampler's root, ``run``)."""
    text = " ".join(command_line)
    if "pipeline.kafka.embedded.objectstore" in text:
        return "store"
    if name == "tansu" or text.endswith("tansu") or "/tansu " in text:
        return "broker"
    if name.startswith("VLLM") or "EngineCore" in name:
        return "engine"
    if "pipeline.process.reaper" in text:
        return "reaper"
    return "other"


class CpuSampler:
    """CPU seconds per role of a process tree, kept from the last sample of each process.

    A process's counters vanish with it, so the tree is sampled while the job runs and
    the last reading of every pid counts.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self._last: dict[int, tuple[str, float]] = {}

    def sample(self) -> None:
        try:
            parent = psutil.Process(self.root)
            processes = [parent, *parent.children(recursive=True)]
        except psutil.Error:
            return
        for process in processes:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    role = (
                        "run" if process.pid == self.root else process_role(process.cmdline(), process.name())
                    )
            except psutil.Error:
                continue
            self._last[process.pid] = (role, times.user + times.system)

    def by_role(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for role, seconds in self._last.values():
            totals[role] = round(totals.get(role, 0.0) + seconds, 2)
        return dict(sorted(totals.items()))


def run_trial(storage: str, rollouts: int, model_dir: Path, config: MainJobConfig) -> dict[str, Any]:
    """One ``tokentrail run`` with ``storage``; its summary figures, wall time and CPU."""
    with tempfile.TemporaryDirectory(prefix=f"main-job-{storage}-") as data_dir:
        argv = [
            sys.executable, "-m", "pipeline.cli", "run",
            "--data-dir", data_dir,
            "--model", str(model_dir),
            "--rollouts", str(rollouts),
            "--concurrency", str(config.concurrency),
            "--broker-storage", storage,
            "--json", "--log-format", "json",
            *config.run_args,
        ]  # fmt: skip
        out, err = Path(data_dir) / "summary.json", Path(data_dir) / "stderr.log"
        began = time.monotonic()
        with out.open("wb") as stdout, err.open("wb") as stderr:
            job = subprocess.Popen(argv, stdout=stdout, stderr=stderr)
        sampler = CpuSampler(job.pid)
        while job.poll() is None:
            sampler.sample()
            if time.monotonic() - began > config.timeout_s:
                job.kill()
            time.sleep(SAMPLE_EVERY_S)
        wall_s = time.monotonic() - began
        if job.returncode != 0:
            tail = err.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {storage} main job exited {job.returncode}:\n{tail}")
        summary = json.loads(out.read_bytes())
    return {
        "storage": storage,
        "rollouts": rollouts,
        "wall_s": round(wall_s, 2),
        "drive_s": summary["drive_s"],
        "elapsed_s": summary["elapsed_s"],
        "accepted": summary["accepted"],
        "lag": summary["lag"],
        "calls": summary["calls"],
        "cpu_s": sampler.by_role(),
    }


def summarize(trials: list[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    """Median wall and drive times per size and storage, and the durable/memory ratios."""
    per_size: dict[str, Any] = {}
    for size in sizes:
        medians: dict[str, dict[str, float]] = {}
        for storage in STORAGES:
            runs = [t for t in trials if t["rollouts"] == size and t["storage"] == storage]
            medians[storage] = {
                "wall_s": statistics.median(t["wall_s"] for t in runs),
                "drive_s": statistics.median(t["drive_s"] for t in runs),
            }
        per_size[str(size)] = {
            **medians,
            "durable_over_memory": round(medians["durable"]["wall_s"] / medians["memory"]["wall_s"], 3),
            "durable_over_memory_drive": round(
                medians["durable"]["drive_s"] / medians["memory"]["drive_s"], 3
            ),
        }
    largest = per_size[str(max(sizes))]
    return {
        "sizes": per_size,
        "largest": max(sizes),
        "durable_over_memory": largest["durable_over_memory"],
        "durable_over_memory_drive": largest["durable_over_memory_drive"],
        "target": TARGET_RATIO,
        "all_accepted": all(t["accepted"] == t["rollouts"] for t in trials),
        "lag_zero": all(t["lag"] == 0 for t in trials),
    }


def make_model(directory: Path) -> Path:
    model_dir = directory / "tiny-model"
    subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "make-tiny-model", str(model_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return model_dir


def run(config: MainJobConfig | None = None) -> dict[str, Any]:
    """Every size, the storages alternating trial by trial; returns the report."""
    config = config or MainJobConfig()
    trials: list[dict[str, Any]] = []
    load_before = machine()
    with tempfile.TemporaryDirectory(prefix="main-job-model-") as scratch:
        model_dir = make_model(Path(scratch))
        for size in config.sizes:
            for trial in range(config.trials):
                order = STORAGES if trial % 2 == 0 else tuple(reversed(STORAGES))
                trials += [run_trial(storage, size, model_dir, config) for storage in order]
    return {
        "benchmark": "main-job",
        "config": asdict(config),
        "machine": load_before,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "versions": versions(),
        "trials": trials,
        "summary": summarize(trials, config.sizes),
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        "| rollouts | storage | wall s | drive s | accepted | lag | CPU s by process |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for t in report["trials"]:
        cpu = ", ".join(f"{role} {seconds:.1f}" for role, seconds in t["cpu_s"].items())
        lines.append(
            f"| {t['rollouts']} | {t['storage']} | {t['wall_s']:.1f} | {t['drive_s']:.1f} "
            f"| {t['accepted']}/{t['rollouts']} | {t['lag']} | {cpu} |"
        )
    summary = report["summary"]
    lines.append(
        f"durable/memory at {summary['largest']} rollouts: wall {summary['durable_over_memory']:.2f}, "
        f"driving {summary['durable_over_memory_drive']:.2f} (target <= {summary['target']})"
    )
    return "\n".join(lines)


BENCHMARK = Benchmark("main-job", __doc__, MainJobConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
