"""Cost of the Megatron capture hooks per call, inside the engine step.

A call of N tokens is a ``token_in`` turn whose cumulative length is N: an exact prefix
of N/2, N/4 new template tokens and N/4 generated tokens (the layout of ``bench.digest``).
Times are medians in µs over ``--repeats`` calls (``min_us``: the fastest, i.e. the cost
without interference from other processes), measured around the hook call only (setup
is not counted):

- ``prepare_exact``: ``prepare_prompt`` for a token-id prompt that already starts
  with the exact prefix; ``prepare_splice``: the same prompt given as a re-render
  plus its history render, so the prefix is spliced (DESIGN §5).
- ``stage_list`` / ``stage_numpy``: ``stage`` with the payload as Python lists
  (Megatron-LM main's ``OffloadedRequestPayload``) or as numpy arrays.
- ``read``: reading and validating the payload (lists), part of ``stage``.
- ``hashing``: chain hash + cumulative hash + call digest of the call, part of
  ``stage``; ``hashing_MBps`` divides the bytes those three hash (``hashed_MB``) by its median.
- ``complete``: ``CaptureCore.complete`` on the same call, for comparison: what
  ``stage`` would cost if it ran the capture core inline; ``complete_root``: the same
  ids as an entirely new (root) call, whose delta is the whole call.

    tokentrail bench megatron-hooks [--quick] [--json] [--sizes 1000,8000,32000] [--repeats 50]
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.command import Benchmark, Option, Quick, ints
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore, PreparedCall
from stages.capture.megatron.payload import read_finished_call
from stages.capture.megatron.preparer import TEMPLATE_PREFIX_FIELD, MegatronPromptPreparer
from stages.capture.megatron.registry import PreparedCalls
from stages.capture.megatron.stager import MegatronPayloadStager
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.memory import MemoryDataPlane, RecordingSink
from topics import digest
from topics.records import CaptureAdmission
from topics.staging import build_row
from topics.wire import CAPTURE_FIELD

_NO_IDS = np.zeros(0, dtype=np.int64)
EOS = 2


@dataclass(frozen=True, slots=True)
class MegatronHooksConfig:
    sizes: tuple[int, ...] = (1_000, 8_000, 32_000)
    """Cumulative tokens per call."""
    repeats: int = 50
    seed: int = 0


QUICK = Quick("1,000 tokens, 8 calls per measure", MegatronHooksConfig(sizes=(1_000,), repeats=8))
OPTIONS = (
    Option("--sizes", "cumulative tokens per call (default 1000,8000,32000)", ints),
    Option("--repeats", "calls per measure, median kept (default 50)", int),
)


class Timing(dict[str, float]):
    """``{"median_us": ..., "min_us": ...}`` of one measure."""

    @property
    def median(self) -> float:
        return self["median_us"]


def _timed(fn: Callable[[], object], setup: Callable[[], object], repeats: int) -> Timing:
    """µs of ``fn`` over ``repeats`` calls, each after an untimed ``setup``."""
    samples: list[float] = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return Timing(median_us=round(statistics.median(samples), 1), min_us=round(min(samples), 1))


class _Call:
    """One token_in call of ``n`` cumulative tokens, with everything the hooks receive."""

    def __init__(self, n: int, rng: np.random.Generator) -> None:
        prefix = rng.integers(3, 150_000, n // 2)
        prefix[-1] = EOS  # the previous turn ended on EOS
        new = rng.integers(3, 150_000, n // 4)
        new[0] = EOS  # the boundary EOS the template writes
        generated = rng.integers(3, 150_000, n - prefix.size - new.size)
        self.prefix = prefix.astype(np.int64)
        self.prompt = np.concatenate((self.prefix, new)).tolist()
        self.generated = generated.tolist()
        self.logprobs = (-rng.random(generated.size)).tolist()
        self.history = self.prefix.tolist()  # the render through the last assistant turn
        self.admission = CaptureAdmission(
            rollout_id="r",
            call_id="c2",
            parent_call_id="c1",
            mode="token_in",
            prev_len=int(self.prefix.size),
            staging_chain=["r/c1"],
            parent_chain_hash="1" * 64,
            admitted_at=time.time(),
        )
        self.prepared = PreparedCall(self.admission, self.prefix, "1" * 64)
        self.params = {CAPTURE_FIELD: self.admission.model_dump(mode="json"), "ng_capture_key": "r/c2"}
        self.payload = {
            "prompt_token_ids": self.prompt,
            "generated_token_ids": self.generated,
            "generated_log_probs": self.logprobs,
        }
        self.numpy_payload = {key: np.asarray(value) for key, value in self.payload.items()}
        self.metadata = {"policy_epoch": [(0, 1)]}


async def _timed_stage(
    stager: MegatronPayloadStager, registry: PreparedCalls, call: _Call, payload: Any, repeats: int
) -> Timing:
    """``stage`` in steady state: the capture loop catches up (untimed) between calls, as it
    does beside a running engine, so each call's arrays are freed before the next one."""
    samples: list[float] = []
    for _ in range(repeats):
        registry.hold(call.admission.staging_key, call.prepared)
        start = time.perf_counter_ns()
        stager.stage("u", payload, finished_metadata=call.metadata, offload_params=call.params)
        samples.append((time.perf_counter_ns() - start) / 1e3)
        await stager.drain()
    return Timing(median_us=round(statistics.median(samples), 1), min_us=round(min(samples), 1))


def _hashes(call: _Call) -> Callable[[], object]:
    """The three hashes ``stage`` computes, over the arrays it builds them from."""
    prompt = np.asarray(call.prompt, dtype=np.int64)
    delta = digest.build_delta(prompt, call.generated, call.logprobs, call.prefix.size)
    row = build_row(
        rollout_id="r",
        call_id="c2",
        parent_call_id="c1",
        parent_chain_hash="1" * 64,
        prefix_ids=call.prefix,
        delta=delta,
        weight_version=1,
    )
    delta_be = delta.token_ids.astype(">u8")
    prefix_be = call.prefix.astype(">u8")
    mask_be, logprobs_be = delta.token_mask.astype(">f4"), delta.logprobs.astype(">f4")

    def run() -> None:
        digest.chain_hash("1" * 64, delta_be)
        digest.cumulative_hash_of_parts(prefix_be, delta_be)
        digest.digest_of_canonical(row, delta_be, mask_be, logprobs_be)

    return run


def _hashed_mb(n_total: int, n_delta: int) -> float:
    """Bytes hashed: chain (8/id of the delta), cumulative (8/id), call digest (8+4+4/delta id)."""
    return (8 * n_delta + 8 * n_total + 16 * n_delta) / 1e6


async def _measure(n: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    call = _Call(n, rng)
    data_plane, sink = MemoryDataPlane(), RecordingSink()
    cache = ChainCache()
    writer = StagingWriter(data_plane, sink, worker_id="bench", batch_delay_s=0.0)
    core = CaptureCore(PrefixResolver(data_plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
    registry = PreparedCalls()
    preparer = MegatronPromptPreparer(core, registry, eos_token_ids=[EOS])
    stager = MegatronPayloadStager(core, registry, max_pending=1_000_000)
    writer.start()
    stager.start()
    key = call.admission.staging_key

    def prefetched() -> None:
        registry.begin(key)
        registry.resolve(key, call.prepared)

    splice_params = {**call.params, TEMPLATE_PREFIX_FIELD: call.history}
    result: dict[str, Any] = {"tokens": n, "delta_tokens": n - call.prefix.size}
    result["prepare_exact"] = _timed(
        lambda: preparer.prepare_prompt(call.prompt, offload_params=call.params), prefetched, repeats
    )
    rerender = [*call.prefix[:-1].tolist(), 7, EOS, *call.prompt[call.prefix.size + 1 :]]
    result["prepare_splice"] = _timed(
        lambda: preparer.prepare_prompt(rerender, offload_params=splice_params), prefetched, repeats
    )
    assert preparer.stats.spliced == repeats and not preparer.stats.failed, preparer.stats

    for name, payload in (("stage_list", call.payload), ("stage_numpy", call.numpy_payload)):
        result[name] = await _timed_stage(stager, registry, call, payload, repeats)
    assert not stager.stats.failed and stager.stats.superseded == 0, stager.stats
    result["read"] = _timed(
        lambda: read_finished_call(call.payload, call.metadata),
        lambda: None,
        repeats,
    )
    hashing = _timed(_hashes(call), lambda: None, repeats)
    result["hashing"] = hashing
    result["hashing_MBps"] = round(_hashed_mb(n, n - call.prefix.size) / (hashing.median / 1e6), 1)
    result["hashed_MB"] = round(_hashed_mb(n, n - call.prefix.size), 3)
    result["complete"] = _timed(
        lambda: core.complete(call.prepared, call.prompt, call.generated, call.logprobs, weight_version=1),
        lambda: None,
        max(3, repeats // 4),
    )
    root = PreparedCall(
        CaptureAdmission(rollout_id="r", call_id="c0", mode="text", prev_len=0, admitted_at=0.0),
        _NO_IDS,
        None,
    )
    result["complete_root"] = _timed(
        lambda: core.complete(root, call.prompt, call.generated, call.logprobs, weight_version=1),
        lambda: None,
        max(3, repeats // 4),
    )
    await stager.stop()
    await writer.stop()
    return result


def run(config: MegatronHooksConfig = MegatronHooksConfig()) -> dict[str, Any]:
    """Median hook costs per call size; see the module docstring for each field."""
    rng = np.random.default_rng(config.seed)
    results = [asyncio.run(_measure(n, config.repeats, rng)) for n in config.sizes]
    return {
        "benchmark": "megatron_hooks",
        "repeats": config.repeats,
        "python": platform.python_version(),
        "results": results,
    }


TIMINGS = (
    "prepare_exact",
    "prepare_splice",
    "stage_list",
    "stage_numpy",
    "read",
    "hashing",
    "complete",
    "complete_root",
)


def render(report: dict[str, Any]) -> str:
    """Per measure, median µs and (in brackets) the fastest call, one column per call size."""
    rows = report["results"]
    lines = [
        "| µs, median (fastest) | " + " | ".join(f"{row['tokens']:,} tokens" for row in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for name in TIMINGS:
        cells = " | ".join(f"{row[name]['median_us']:,.1f} ({row[name]['min_us']:,.1f})" for row in rows)
        lines.append(f"| {name} | {cells} |")
    lines.append("| hashing MB/s | " + " | ".join(f"{row['hashing_MBps']:,.0f}" for row in rows) + " |")
    return "\n".join(lines)


BENCHMARK = Benchmark("megatron-hooks", __doc__, MegatronHooksConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
