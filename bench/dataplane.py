"""Data-plane throughput: single-row and batched put/get of staged rows through TransferQueue.

Rows are real ``StagedCall`` rows (int64 ids, float32 mask and logprobs, JSON metadata)
of 1K and 8K tokens. Each case reports rows/s, payload MB/s (the encoded rows, 16 bytes
per token plus metadata; 1 MB = 10^6 bytes), per-call latency percentiles and the CPU
this process spent per row.

Two placements of the data plane:

- ``embedded``: controller and storage unit in this process, as a tokentrail process
  that owns the data plane uses it (client and server share one interpreter);
- ``separate``: a ``tokentrail dataplane`` child process owns it and this process
  attaches through its address file, as a worker or stage does.

    tokentrail bench dataplane [--quick] [--json] [--placements embedded,separate]
        [--tokens 1024,8192] [--batch 32] [--rows 256]

torch and TransferQueue are imported when it runs, not when the command line starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.command import Benchmark, Option, Quick, ints, names
from pipeline.dataplane.addresses import DataPlaneAddresses
from topics import digest
from topics.records import StagedCall
from topics.staging import staging_row

if TYPE_CHECKING:
    from pipeline.dataplane.transferqueue import TransferQueueDataPlane

REPO = Path(__file__).resolve().parents[1]
PLACEMENTS = ("embedded", "separate")


@dataclass(frozen=True, slots=True)
class DataPlaneBenchConfig:
    placements: tuple[str, ...] = PLACEMENTS
    tokens: tuple[int, ...] = (1024, 8192)
    """Tokens per row, one case each."""
    batch: int = 32
    """Rows per batched put or get."""
    rows: int = 256
    """Rows per case."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.placements if name not in PLACEMENTS]
        if unknown or not self.placements:
            raise ValueError(f"placements: {unknown or 'none'}; choose from {', '.join(PLACEMENTS)}")


QUICK = Quick("1,024 tokens a row, embedded, 64 rows", DataPlaneBenchConfig(("embedded",), (1024,), rows=64))
OPTIONS = (
    Option("--placements", "where the data plane runs, comma separated (default embedded,separate)", names),
    Option("--tokens", "tokens per row, comma separated (default 1024,8192)", ints),
    Option("--batch", "rows per batched put or get (default 32)", int),
    Option("--rows", "rows per case (default 256)", int),
)


def make_rows(count: int, tokens: int, *, tag: str, seed: int = 0) -> list[StagedCall]:
    """``count`` root calls of ``tokens`` tokens each (a quarter prompt, the rest generated)."""
    rng = np.random.default_rng(seed)
    generated = tokens - tokens // 4
    rows = []
    for i in range(count):
        delta = digest.build_delta(
            rng.integers(0, 150_000, tokens // 4),
            rng.integers(0, 150_000, generated),
            -rng.random(generated) * 8,
            0,
        )
        rows.append(
            staging_row(
                rollout_id=f"{tag}-{i}",
                call_id="c0",
                parent_call_id=None,
                parent_chain_hash=None,
                prefix_ids=[],
                delta=delta,
                weight_version=1,
            )
        )
    return rows


def payload_bytes(rows: Sequence[StagedCall]) -> int:
    from pipeline.dataplane import encoding as codec

    data = codec.encode_calls(rows)
    return sum(part.numel() for part in data.get(codec.ROW_FIELD).tolist())


@dataclass(frozen=True, slots=True)
class Timed:
    """Each call's wall time, and the CPU this process spent over all of them."""

    latencies: list[float]
    cpu_s: float


async def timed(calls: Sequence[Callable[[], Awaitable[Any]]]) -> Timed:
    latencies = []
    cpu_start = time.process_time()
    for call in calls:
        start = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - start)
    return Timed(latencies, time.process_time() - cpu_start)


def summarize(measured: Timed, rows_per_call: int, bytes_per_row: float) -> dict[str, float]:
    """Rows/s, MB/s, latency percentiles, and CPU µs per row in this process (the client;
    with the embedded placement the server's threads too)."""
    latencies = measured.latencies
    total = sum(latencies)
    rows = rows_per_call * len(latencies)
    return {
        "calls": len(latencies),
        "rows_per_s": rows / total,
        "mb_per_s": rows * bytes_per_row / total / 1e6,
        "cpu_us_per_row": measured.cpu_s / rows * 1e6,
        "p50_ms": float(np.percentile(latencies, 50)) * 1e3,
        "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
    }


async def measure(plane: TransferQueueDataPlane, tokens: int, batch: int, rows: int) -> dict[str, Any]:
    """Single-row and ``batch``-row put then get of ``rows`` rows of ``tokens`` tokens."""
    from pipeline.dataplane import encoding as codec

    single = make_rows(rows, tokens, tag=f"single{tokens}", seed=tokens)
    batched = make_rows(rows, tokens, tag=f"batch{tokens}", seed=tokens + 1)
    per_row = payload_bytes(single[:batch]) / min(batch, len(single))
    await plane.put_calls(single[:1])  # warm up sockets
    await plane.get_calls([single[0].staging_key])
    groups = [batched[i : i + batch] for i in range(0, len(batched), batch)]

    def put_one(row: StagedCall) -> Callable[[], Awaitable[None]]:
        return lambda: plane.put_calls([row])

    def put_many(group: list[StagedCall]) -> Callable[[], Awaitable[None]]:
        return lambda: plane.put_calls(group)

    def get(keys: list[str]) -> Callable[[], Awaitable[Any]]:
        return lambda: plane.get_calls(keys)

    result = {
        "tokens": tokens,
        "bytes_per_row": per_row,
        "single_put": summarize(await timed([put_one(r) for r in single]), 1, per_row),
        "single_get": summarize(await timed([get([r.staging_key]) for r in single]), 1, per_row),
        "batch_put": summarize(await timed([put_many(g) for g in groups]), batch, per_row),
        "batch_get": summarize(
            await timed([get([r.staging_key for r in g]) for g in groups]), batch, per_row
        ),
    }
    result.update(await measure_raw(plane.client, tokens, batch, rows, per_row))
    start = time.perf_counter()
    encoded = [codec.encode_calls(g) for g in groups]
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    for group, data in zip(groups, encoded, strict=True):
        codec.decode_calls([r.staging_key for r in group], data)
    decode_s = time.perf_counter() - start
    result["codec_rows_per_s"] = {"encode": len(batched) / encode_s, "decode": len(batched) / decode_s}
    await plane.delete_calls([r.staging_key for r in single + batched])
    return result


async def measure_raw(client: Any, tokens: int, batch: int, rows: int, per_row: float) -> dict[str, Any]:
    """TransferQueue's floor: the same bytes per row as one dense int64 field, no codec, no checks.

    This is what ``kv_batch_put`` / ``kv_batch_get`` do (metadata call, then data), so the
    gap to the rows above is what typed multi-field rows and the guards cost.
    """
    import torch
    from tensordict import TensorDict

    width = int(per_row) // 8
    partition = f"raw{tokens}"

    async def put(keys: list[str]) -> None:
        data = TensorDict({"blob": torch.zeros(len(keys), width, dtype=torch.int64)}, batch_size=[len(keys)])
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=True)
        await client.async_put(data, meta)

    async def get(keys: list[str]) -> None:
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition)
        await client.async_get_data(meta.select_fields(["blob"]))

    singles = [[f"s{i}"] for i in range(rows)]
    groups = [[f"b{i}" for i in range(start, min(start + batch, rows))] for start in range(0, rows, batch)]

    def calls(
        op: Callable[[list[str]], Awaitable[None]], key_lists: list[list[str]]
    ) -> list[Callable[[], Awaitable[None]]]:
        return [functools.partial(op, keys) for keys in key_lists]

    result = {
        "raw_single_put": summarize(await timed(calls(put, singles)), 1, per_row),
        "raw_single_get": summarize(await timed(calls(get, singles)), 1, per_row),
        "raw_batch_put": summarize(await timed(calls(put, groups)), batch, per_row),
        "raw_batch_get": summarize(await timed(calls(get, groups)), batch, per_row),
    }
    every = [key for keys in singles + groups for key in keys]
    await client.async_clear_samples(await client.async_kv_retrieve_meta(keys=every, partition_id=partition))
    return result


def start_owner(data_dir: str) -> subprocess.Popen[str]:
    """``tokentrail dataplane`` in a child process; its first stdout line is the addresses."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "dataplane", "--data-dir", data_dir, "--json"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )


def stop_owner(child: subprocess.Popen[str]) -> None:
    child.terminate()
    child.wait(timeout=30)


@contextlib.asynccontextmanager
async def separate_data_plane(timeout_s: float) -> AsyncIterator[TransferQueueDataPlane]:
    """A data plane owned by a child process, attached to through its address file."""
    from pipeline.dataplane.transferqueue import TransferQueueDataPlane

    with tempfile.TemporaryDirectory() as data_dir:
        child = start_owner(data_dir)
        try:
            assert child.stdout is not None
            line = await asyncio.to_thread(child.stdout.readline)
            if not line:
                raise RuntimeError(f"tokentrail dataplane exited with {child.poll()}")
            addresses = DataPlaneAddresses.read(Path(json.loads(line)["addresses_file"]))
            async with await TransferQueueDataPlane.attach(addresses, timeout_s=timeout_s) as plane:
                yield plane
        finally:
            await asyncio.to_thread(stop_owner, child)


async def run_async(config: DataPlaneBenchConfig) -> dict[str, Any]:
    import ray
    import torch
    import transfer_queue

    from pipeline.dataplane.embedded import embedded_data_plane

    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "TQ_NUM_THREADS": os.environ.get("TQ_NUM_THREADS"),
        },
        "versions": {
            "transferqueue": transfer_queue.__version__,
            "torch": torch.__version__,
            "ray": ray.__version__,
        },
        "batch": config.batch,
        "rows_per_case": config.rows,
        "results": {},
    }
    for placement in config.placements:
        opener = embedded_data_plane(timeout_s=60.0) if placement == "embedded" else separate_data_plane(60.0)
        async with opener as plane:
            report["results"][placement] = [
                await measure(plane, tokens, config.batch, config.rows) for tokens in config.tokens
            ]
    return report


def run(config: DataPlaneBenchConfig = DataPlaneBenchConfig()) -> dict[str, Any]:
    """Run every case and return the report; TransferQueue's threads default to the cores, at most 8."""
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))
    return asyncio.run(run_async(config))


CASES = (
    "single_put",
    "single_get",
    "batch_put",
    "batch_get",
    "raw_single_put",
    "raw_single_get",
    "raw_batch_put",
    "raw_batch_get",
)


def render(report: dict[str, Any]) -> str:
    lines = [
        "| placement | tokens/row | case | rows/s | MB/s | p50 ms | p99 ms | CPU µs/row (this process) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for placement, cases in report["results"].items():
        for case in cases:
            for name in CASES:
                m = case[name]
                label = name.replace("batch", f"batch{report['batch']}").replace("_", " ")
                lines.append(
                    f"| {placement} | {case['tokens']} | {label} | {m['rows_per_s']:,.0f} | "
                    f"{m['mb_per_s']:,.1f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['cpu_us_per_row']:,.0f} |"
                )
    return "\n".join(lines)


BENCHMARK = Benchmark("dataplane", __doc__, DataPlaneBenchConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
