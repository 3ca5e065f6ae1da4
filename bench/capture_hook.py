"""Cost of the capture core's completion hook per call, with hashing measured apart.

The hook is ``CaptureCore.complete`` for a child call whose prefix (half the tokens) is
already resolved; the writer is not running, so no I/O is timed, exactly what the
engine's completion path pays. Medians over ``--repeats`` calls.

    tokentrail bench capture-hook [--quick] [--json] [--sizes 1000,8000,32000] [--repeats 40]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.command import Benchmark, Option, Quick, ints
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore, PreparedCall
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics import digest
from topics.staging import staging_row


@dataclass(frozen=True, slots=True)
class CaptureHookConfig:
    sizes: tuple[int, ...] = (1_000, 8_000, 32_000)
    """Tokens per call."""
    repeats: int = 40


QUICK = Quick("1,000 tokens, 10 calls", CaptureHookConfig(sizes=(1_000,), repeats=10))
OPTIONS = (
    Option("--sizes", "tokens per call (default 1000,8000,32000)", ints),
    Option("--repeats", "calls timed per size, median kept (default 40)", int),
)


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


async def measure(n: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    plane, sink = MemoryDataPlane(), RecordingSink()
    cache = ChainCache(max_bytes=2**32)
    writer = StagingWriter(plane, sink, worker_id="bench", max_queue=10**6)
    core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
    client = RolloutClient(sink)
    prefix = rng.integers(0, 150_000, n // 2).tolist()
    root = core.complete(
        await core.prepare(client.admit("r")), prefix[:-8], prefix[-8:], [-0.5] * 8, weight_version=0
    ).coords
    new = rng.integers(0, 150_000, n // 4).tolist()
    generated = rng.integers(0, 150_000, n - n // 2 - n // 4).tolist()
    logprobs = (-rng.random(len(generated))).tolist()
    prompt = prefix + new
    totals: list[float] = []
    hashing: list[float] = []
    for _ in range(repeats):
        prepared: PreparedCall = await core.prepare(client.admit("r", root))
        start = time.perf_counter()
        core.complete(prepared, prompt, generated, logprobs, weight_version=0)
        totals.append(time.perf_counter() - start)
        delta = digest.build_delta(prompt, generated, logprobs, len(prefix))
        row = staging_row(
            rollout_id="r",
            call_id="x",
            parent_call_id="p",
            parent_chain_hash="0" * 64,
            prefix_ids=prepared.prefix_ids,
            delta=delta,
            weight_version=0,
        )
        start = time.perf_counter()
        digest.extras_digest(None)
        digest.chain_hash(prepared.parent_chain_hash, delta.token_ids)
        digest.cumulative_hash(np.concatenate((prepared.prefix_ids, delta.token_ids)))
        digest.digest_of_row(row, delta.token_ids, delta.token_mask, delta.logprobs)
        hashing.append(time.perf_counter() - start)
    total, hashed = _median_us(totals), _median_us(hashing)
    return {
        "tokens": n,
        "hook_us": total,
        "hashing_us": hashed,
        "hook_minus_hashing_us": round(total - hashed, 1),
    }


def run(config: CaptureHookConfig = CaptureHookConfig()) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    async def go() -> list[dict[str, Any]]:
        return [await measure(n, config.repeats, rng) for n in config.sizes]

    return {"benchmark": "capture_hook", "results": asyncio.run(go())}


def render(report: dict[str, Any]) -> str:
    lines = ["| tokens | hook µs | hashing µs | hook without hashing µs |", "|---:|---:|---:|---:|"]
    for row in report["results"]:
        lines.append(
            f"| {row['tokens']:,} | {row['hook_us']:,.1f} | {row['hashing_us']:,.1f} "
            f"| {row['hook_minus_hashing_us']:,.1f} |"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("capture-hook", __doc__, CaptureHookConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
