"""Cost of the capture core's completion hook per call, with hashing measured apart.

Run: ``python -m bench.capture_hook [--json]``. The hook is ``CaptureCore.complete``
for a child call whose prefix (half the tokens) is already resolved; the writer is
not running, so no I/O is timed, exactly what the engine's completion path pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore, PreparedCall
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics import digest
from topics.staging import staging_row

SIZES = (1_000, 8_000, 32_000)


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


def run(sizes: tuple[int, ...] = SIZES, repeats: int = 40) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    async def go() -> list[dict[str, Any]]:
        return [await measure(n, repeats, rng) for n in sizes]

    return {"benchmark": "capture_hook", "results": asyncio.run(go())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run()
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
