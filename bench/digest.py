"""Digest throughput: MB/s of token bytes and records/s, for list and numpy inputs.

Token bytes are counted as the 8-byte big-endian encoding the digests hash. "row" is
``staging_row`` building a complete, digested row from a delta of N/2 tokens on a
prefix of N/2.

    tokentrail bench digest [--quick] [--json] [--sizes 1000,8000,32000]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from bench.command import Benchmark, Option, Quick, ints
from bench.common import best_of
from topics import digest
from topics.staging import staging_row


@dataclass(frozen=True, slots=True)
class DigestConfig:
    sizes: tuple[int, ...] = (1_000, 8_000, 32_000)
    """Tokens per call."""
    seed: int = 0


QUICK = Quick("1,000 tokens only", DigestConfig(sizes=(1_000,)))
OPTIONS = (Option("--sizes", "tokens per call (default 1000,8000,32000)", ints),)


def _row_for(n: int, rng: np.random.Generator) -> tuple[list[int], digest.Delta]:
    prefix = rng.integers(0, 150_000, n // 2).tolist()
    prompt = prefix + rng.integers(0, 150_000, n // 4).tolist()
    generated = rng.integers(0, 150_000, n - len(prompt)).tolist()
    logprobs = (-rng.random(len(generated))).tolist()
    return prefix, digest.build_delta(prompt, generated, logprobs, len(prefix))


def run(config: DigestConfig = DigestConfig()) -> dict[str, Any]:
    rng = np.random.default_rng(config.seed)
    results: list[dict[str, Any]] = []
    for n in config.sizes:
        ids_list = rng.integers(0, 150_000, n).tolist()
        ids_array = np.asarray(ids_list, dtype=np.int64)
        repeats = max(10, 2_000_000 // n)
        mb = n * 8 / 1e6
        hash_list = best_of(partial(digest.cumulative_hash, ids_list), repeats)
        hash_array = best_of(partial(digest.cumulative_hash, ids_array), repeats)
        prefix, delta = _row_for(n, rng)
        row_repeats = max(5, repeats // 10)
        full_row = best_of(
            partial(
                staging_row,
                rollout_id="r",
                call_id="c2",
                parent_call_id="c1",
                parent_chain_hash="0" * 64,
                prefix_ids=np.asarray(prefix, dtype=np.int64),
                delta=delta,
                weight_version=0,
            ),
            row_repeats,
        )
        results.append(
            {
                "tokens": n,
                "cumulative_hash_list_MBps": round(mb / hash_list, 1),
                "cumulative_hash_numpy_MBps": round(mb / hash_array, 1),
                "row_records_per_s": round(1 / full_row, 1),
                "row_us": round(full_row * 1e6, 1),
            }
        )
    return {"benchmark": "digest", "results": results}


def render(report: dict[str, Any]) -> str:
    lines = [
        "| tokens | cumulative hash, list input, MB/s | cumulative hash, numpy input, MB/s | row µs | rows/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['tokens']:,} | {row['cumulative_hash_list_MBps']:,.0f} "
            f"| {row['cumulative_hash_numpy_MBps']:,.0f} | {row['row_us']:,.0f} | {row['row_records_per_s']:,.0f} |"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("digest", __doc__, DigestConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
