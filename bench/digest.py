"""Digest throughput: MB/s of token bytes and records/s, for list and numpy inputs.

Run: ``python -m bench.digest [--json]``. Token bytes are counted as the 8-byte
big-endian encoding the digests hash.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import numpy as np

from bench.common import best_of
from topics import digest
from topics.staging import staging_row

SIZES = (1_000, 8_000, 32_000)


def _row_for(n: int, rng: np.random.Generator) -> tuple[list[int], digest.Delta]:
    prefix = rng.integers(0, 150_000, n // 2).tolist()
    prompt = prefix + rng.integers(0, 150_000, n // 4).tolist()
    generated = rng.integers(0, 150_000, n - len(prompt)).tolist()
    logprobs = (-rng.random(len(generated))).tolist()
    return prefix, digest.build_delta(prompt, generated, logprobs, len(prefix))


def run(sizes: tuple[int, ...] = SIZES, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    results: list[dict[str, Any]] = []
    for n in sizes:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    report = run()
    if args.json:
        print(json.dumps(report))
        return
    for row in report["results"]:
        print(row)


if __name__ == "__main__":
    main()
