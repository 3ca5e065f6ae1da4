"""TransferQueue's controller ceiling: operations per second per controller core.

Every put, read and delete of a row asks TransferQueue's controller for metadata, and
the controller serves all of them, one at a time, in one Python thread (DESIGN §9.1).
Here the data plane runs as its own process (``tokentrail dataplane``, its threads
named by ``bench.named_threads``), and K client processes drive it, each one operation
of one small row at a time, the worst case for the controller (a capture batch of one
row, a finalizer reading and deleting one row):

- ``put``: ``put_calls`` of one new row (3 controller requests: allocate, the storage
  manager's notice that the data landed, the read-back; 1 to the storage unit);
- ``get``: ``get_calls`` of one row the client put (1 controller request, 1 storage);
- ``meta``: the metadata lookup alone (``kv_retrieve_meta``, 1 controller request): the
  controller's cost per request with no payload anywhere;
- ``delete``: ``delete_calls`` of each row the client put (3 controller requests:
  lookup, mark, clear; 1 storage), until none is left.

Per K and operation: operations/s, latency, and CPU per operation of the controller's
threads (its request thread apart), the storage unit's, the rest of the data plane's
process, and the clients'. The ceiling is ``1 / controller CPU per operation``:
operations per second one controller core serves; the request thread being serial, a
controller cannot pass ``1 / request-thread CPU per operation`` however many cores it
has. The row is tiny (16 tokens), so the storage unit's work is small beside the
controller's, and it is counted apart anyway. On a machine whose cores the clients
share, operations/s is a floor; CPU per operation is the figure to scale.

    tokentrail bench tq-controller [--quick] [--json] [--clients 1,2,4] [--seconds 5] [--tokens 16] [--batch 1]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from bench.command import Benchmark, Option, Quick, ints
from bench.common import machine, percentiles, process_cpu_s, started, thread_cpu_s, versions
from bench.named_threads import CONTROLLER, REQUEST_THREAD, STORAGE


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    clients: tuple[int, ...] = (1, 2, 4)
    seconds: float = 5.0
    """How long each timed operation runs (deletes run until every row put is gone)."""
    tokens: int = 16
    batch: int = 1
    """Rows per operation: 1 is the controller's worst case; more shows what batching buys."""


QUICK = Quick("1 and 2 clients, 1.5 s per operation", ControllerConfig(clients=(1, 2), seconds=1.5))
OPTIONS = (
    Option("--clients", "client processes, one sweep point each (default 1,2,4)", ints),
    Option("--seconds", "seconds per timed operation (default 5)", float),
    Option("--tokens", "tokens per row (default 16)", int),
    Option("--batch", "rows per operation (default 1)", int),
)
OPERATIONS = ("put", "get", "meta", "delete")
CALL = ("put", "get", "delete")
"""One call's life at a batch of one: the worker's put, the finalizer's read and delete."""
CONTROLLER_REQUESTS = {"put": 3, "get": 1, "meta": 1, "delete": 3}
"""Controller requests per operation (TransferQueue 0.1.11 and ``TransferQueueDataPlane``)."""
SATURATED = 0.9
"""Request-thread busy fraction at or above which the controller counts as saturated."""
DENSE_CALLS_PER_S = 10_000
"""The dense 1,000-GPU case of DESIGN §9.1."""
START_DELAY_S = 0.3
READY_TIMEOUT_S = 180.0


# ------------------------------------------------------------------ client processes


def client(
    index: int, addresses_file: str, config: ControllerConfig, commands: Queue[Any], results: Queue[Any]
) -> None:
    """One client process: attach, then run each operation it is sent, until sent None."""
    asyncio.run(_serve(index, Path(addresses_file), config, commands, results))


async def _serve(
    index: int, addresses_file: Path, config: ControllerConfig, commands: Queue[Any], results: Queue[Any]
) -> None:
    from bench.dataplane import make_rows
    from pipeline.dataplane.addresses import DataPlaneAddresses
    from pipeline.dataplane.transferqueue import TransferQueueDataPlane

    template = make_rows(1, config.tokens, tag=f"tqc{index}")[0]
    addresses = DataPlaneAddresses.read(addresses_file)
    async with await TransferQueueDataPlane.attach(addresses, timeout_s=60.0) as plane:
        await plane.put_calls([template])  # connect every socket before the clock starts
        await plane.delete_calls([template.staging_key])
        rows = Rows(plane, template, config.batch)
        results.put(("ready", index))
        while (command := await asyncio.to_thread(commands.get)) is not None:
            operation, seconds, start_at = command
            await asyncio.sleep(max(0.0, start_at - time.time()))
            results.put(await rows.timed(operation, seconds))


class Rows:
    """One client's rows: ``put`` writes new ones, ``get`` and ``meta`` go round those
    written, ``delete`` removes them all; ``size`` rows per operation."""

    def __init__(self, plane: Any, template: Any, size: int) -> None:
        self.plane = plane
        self.template = template
        self.size = size
        self.batches: list[list[str]] = []
        self.written = 0

    async def timed(self, operation: str, seconds: float) -> dict[str, Any]:
        """Run ``operation`` back to back for ``seconds`` (``delete``: until no row is left)."""
        latencies: list[float] = []
        cpu_start, start = time.process_time(), time.perf_counter()
        deadline = start + seconds
        done = 0
        while self.batches if operation == "delete" else time.perf_counter() < deadline:
            began = time.perf_counter()
            await self.once(operation, done)
            latencies.append(time.perf_counter() - began)
            done += 1
        return {
            "ops": done,
            "wall_s": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu_start,
            "latencies": latencies,
        }

    async def once(self, operation: str, done: int) -> None:
        """One operation, as the worker (put) and the finalizer (get, delete) make it."""
        plane = self.plane
        if operation == "put":
            rows = [self._row() for _ in range(self.size)]
            await plane.put_calls(rows)
            self.batches.append([row.staging_key for row in rows])
        elif operation == "get":
            await plane.get_calls(self.batches[done % len(self.batches)])
        elif operation == "meta":
            keys = self.batches[done % len(self.batches)]
            await plane.client.async_kv_retrieve_meta(keys=keys, partition_id=plane.staging_partition)
        else:
            await plane.delete_calls(self.batches.pop())

    def _row(self) -> Any:
        self.written += 1
        return self.template.model_copy(update={"rollout_id": f"{self.template.rollout_id}-{self.written}"})


# ------------------------------------------------------------------ the data plane's CPU


def owner_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of the data plane's process: its controller's request thread, all
    the controller's threads, the storage unit's, and the whole process."""
    threads = thread_cpu_s(pid)
    return {
        "request": threads.get(REQUEST_THREAD, 0.0),
        "controller": sum(s for name, s in threads.items() if name.startswith(CONTROLLER)),
        "storage": sum(s for name, s in threads.items() if name.startswith(STORAGE)),
        "process": process_cpu_s(pid) or 0.0,
    }


def wait_for_names(pid: int, timeout_s: float = 30.0) -> None:
    """Until the data plane's threads carry their roles (the labeller polls)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = thread_cpu_s(pid)
        if REQUEST_THREAD in names and any(n.startswith(f"{CONTROLLER}zmq") for n in names):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the data plane's threads were not named within {timeout_s:g}s")


# ------------------------------------------------------------------ arithmetic


def summarize(
    operation: str, clients: Sequence[dict[str, Any]], before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """One sweep point: rate, latency, CPU µs per operation by role, how busy the request
    thread was, and the ceiling (operations per second per controller core)."""
    ops: int = sum(c["ops"] for c in clients)
    wall: float = max(c["wall_s"] for c in clients)
    spent = {role: after[role] - before[role] for role in after}

    def per_op_us(seconds: float) -> float:
        return round(seconds / ops * 1e6, 1)

    controller_us = per_op_us(spent["controller"])
    latencies = [seconds for c in clients for seconds in c["latencies"]]
    return {
        "operation": operation,
        "clients": len(clients),
        "ops": ops,
        "ops_per_s": round(ops / wall, 1),
        "latency_ms": {k: round(v * 1000, 3) for k, v in percentiles(latencies).items()},
        "cpu_us_per_op": {
            "controller": controller_us,
            "request_thread": per_op_us(spent["request"]),
            "storage": per_op_us(spent["storage"]),
            "rest_of_process": per_op_us(spent["process"] - spent["controller"] - spent["storage"]),
            "clients": per_op_us(sum(c["cpu_s"] for c in clients)),
        },
        "request_thread_busy": round(spent["request"] / wall, 3),
        "ceiling_ops_per_core": ceiling(controller_us),
    }


def ceiling(controller_us_per_op: float) -> float:
    """Operations per second one controller core serves at that CPU per operation."""
    return round(1e6 / controller_us_per_op) if controller_us_per_op > 0 else 0.0


def summary(points: Sequence[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The figures to plan with, from the most loaded sweep point: the ceiling per operation
    and per call (a put, a get and a delete of its row, ``batch`` rows per operation), the
    controller cores the dense case would need at that batch size, and whether the
    controller was saturated."""
    most = max(p["clients"] for p in points)
    at_most = {p["operation"]: p for p in points if p["clients"] == most}
    call_us = sum(at_most[op]["cpu_us_per_op"]["controller"] for op in CALL) / batch
    call_ceiling = ceiling(call_us)
    busy = max(p["request_thread_busy"] for p in at_most.values())
    return {
        "clients": most,
        "ceiling_ops_per_core": {op: p["ceiling_ops_per_core"] for op, p in at_most.items()},
        "controller_us_per_call": round(call_us, 1),
        "ceiling_calls_per_core": call_ceiling,
        "dense_case_controller_cores": round(DENSE_CALLS_PER_S / call_ceiling, 2) if call_ceiling else None,
        "request_thread_busy_max": busy,
        "saturated": busy >= SATURATED,
    }


# ------------------------------------------------------------------ the run


def sweep_point(
    owner: int, commands: Sequence[Queue[Any]], results: Queue[Any], operation: str, seconds: float
) -> dict[str, Any]:
    """Every client in ``commands`` runs ``operation`` at once; the data plane's CPU is read
    around it (it idles before and after, so its idle CPU is all that is added)."""
    before = owner_cpu_s(owner)
    start_at = time.time() + START_DELAY_S
    for queue in commands:
        queue.put((operation, seconds, start_at))
    replies = [results.get(timeout=seconds * 20 + 120) for _ in commands]
    return summarize(operation, replies, before, owner_cpu_s(owner))


def run(config: ControllerConfig | None = None) -> dict[str, Any]:
    """Start the data plane and max(K) clients; then, per K, the first K run each operation."""
    config = config or ControllerConfig()
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))
    load_before = machine()
    points: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-tq-controller-") as scratch, ExitStack() as stack:
        labelled = [sys.executable, "-m", "bench.named_threads", "pipeline.cli"]
        argv = [*labelled, "dataplane", "--data-dir", scratch, "--json"]
        owner, ready = stack.enter_context(started(argv, Path(scratch) / "dataplane.log"))
        wait_for_names(owner.pid)
        results: Queue[Any] = spawn.Queue()
        commands: list[Queue[Any]] = [spawn.Queue() for _ in range(max(config.clients))]
        processes = [
            spawn.Process(target=client, args=(i, ready["addresses_file"], config, queue, results))
            for i, queue in enumerate(commands)
        ]
        for process in processes:
            process.start()
        stack.callback(_stop, processes, commands)
        for _ in processes:
            results.get(timeout=READY_TIMEOUT_S)
        idle_before = owner_cpu_s(owner.pid)
        time.sleep(1.0)
        idle = owner_cpu_s(owner.pid)["process"] - idle_before["process"]
        for count in config.clients:
            for operation in OPERATIONS:
                points.append(sweep_point(owner.pid, commands[:count], results, operation, config.seconds))
    return {
        "benchmark": "tq-controller",
        "config": asdict(config),
        "controller_requests_per_op": CONTROLLER_REQUESTS,
        "idle_cores": round(idle, 4),
        "points": points,
        "summary": summary(points, config.batch),
        "machine": load_before,
        "load_average_after": machine()["load_average"],
        "versions": versions(),
    }


def _stop(processes: Sequence[multiprocessing.process.BaseProcess], commands: Sequence[Queue[Any]]) -> None:
    for queue in commands:
        queue.put(None)
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


def render(report: dict[str, Any]) -> str:
    lines = [
        "| clients | op | ops/s | p50 ms | p99 ms | controller µs/op (request thread) | storage µs/op "
        "| rest of process µs/op | clients µs/op | request thread busy | ops/s per controller core |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in report["points"]:
        cpu = p["cpu_us_per_op"]
        lines.append(
            f"| {p['clients']} | {p['operation']} | {p['ops_per_s']:,.0f} | {p['latency_ms']['p50']:.2f} "
            f"| {p['latency_ms']['p99']:.2f} | {cpu['controller']:,.0f} ({cpu['request_thread']:,.0f}) "
            f"| {cpu['storage']:,.0f} | {cpu['rest_of_process']:,.0f} | {cpu['clients']:,.0f} "
            f"| {p['request_thread_busy']:.2f} | {p['ceiling_ops_per_core']:,.0f} |"
        )
    s = report["summary"]
    lines.append(
        f"\nat {s['clients']} clients: {s['controller_us_per_call']:,.0f} controller µs per call "
        f"(put + get + delete, {report['config']['batch']} row(s) per operation) → {s['ceiling_calls_per_core']:,.0f} calls/s per controller core; "
        f"{DENSE_CALLS_PER_S:,} calls/s needs {s['dense_case_controller_cores']} controller cores; request thread at most {s['request_thread_busy_max']:.2f} busy "
        f"({'saturated' if s['saturated'] else 'not saturated'})"
    )
    return "\n".join(lines)


BENCHMARK = Benchmark("tq-controller", __doc__, ControllerConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
