"""Engine throughput with capture off, inline and tokentrail: does the engine ever wait?

DESIGN §8: engine hooks never do network I/O and never wait. This benchmark puts that to
the test on a step loop driven by a real model (``bench.standin_engine``: continuous
batching, one forward pass of the tiny Hugging Face model per step) with many
concurrent multi-turn rollouts, run three ways in the same process and the same run:

- ``off``: no hooks; the drivers build each turn's prompt from the previous reply;
- ``inline``: upstream-Megatron style (``bench.inline_capture``): the step itself awaits
  the data-plane prefix read before admitting a request and the row write for each
  finished one;
- ``tokentrail``: ``MegatronPromptPreparer`` / ``MegatronPayloadStager`` on a
  ``CaptureCore``: the prefix is prefetched before submission, the hooks only look
  things up and hash, and the background ``StagingWriter`` writes the rows.

The sweep crosses the data-plane latency (the real TransferQueue, and the same with a
fixed delay injected before every call) with the number of requests finishing per step
(the generation budget is ``max_batch / finishing``, and first turns are staggered, so
that many finish in a typical step). Trials run round-robin, the three modes back to
back with their order rotated, so that drift on a shared machine hits them alike; each
trial starts a fresh engine, warms up, then counts the tokens of the steps that end
inside its measuring window. Ratios are medians of the per-round ratios to ``off``.

    tokentrail bench engine [--quick] [--json] [--plot bench/engine_throughput.png]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench.command import Benchmark, Option, Quick, floats, ints
from bench.common import machine, percentiles, process_cpu_s, versions
from bench.planes import PLACEMENTS, Placement, open_plane, with_delay
from bench.standin_engine import (
    BatchEngine,
    CausalLM,
    EngineThread,
    PayloadStager,
    PromptPreparer,
    StepRecord,
)
from stages.ports import STAGING_PARTITION, DataPlane
from topics.records import CaptureAdmission, CommitCoords, Record

Mode = Literal["off", "inline", "tokentrail"]
MODES: tuple[Mode, ...] = ("off", "inline", "tokentrail")
TARGET_RATIO = 0.98  # DESIGN §9: throughput with capture on >= 0.98 x capture off


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The sweep and the workload; ``latencies_ms`` 0 means the data plane as it is."""

    concurrency: int = 32
    max_batch: int = 16
    turns: int = 4
    first_prompt: int = 24
    user_tokens: int = 8
    warmup_s: float = 0.6
    measure_s: float = 2.0
    trials: int = 2
    latencies_ms: tuple[float, ...] = (0.0, 1.0, 5.0, 20.0)
    finishing: tuple[int, ...] = (1, 4, 16)
    placement: Placement = "separate"
    threads: int = 1
    seed: int = 0

    def budget(self, finishing: int) -> int:
        """Generated tokens per call so that ``finishing`` requests end in a typical step."""
        return max(1, self.max_batch // finishing)


DEFAULT = EngineConfig()
QUICK = Quick(
    "one round, two delays, one finishing rate",
    EngineConfig(
        trials=1,
        latencies_ms=(0.0, 5.0),
        finishing=(4,),
        warmup_s=0.3,
        measure_s=1.0,
        concurrency=16,
        max_batch=8,
    ),
)
OPTIONS = (
    Option("--trials", f"round-robin rounds (default {DEFAULT.trials})", int),
    Option(
        "--latencies",
        "injected delays per data-plane call in ms, 0 = none (default 0,1,5,20)",
        floats,
        field="latencies_ms",
    ),
    Option("--finishing", "requests finishing per step (default 1,4,16)", ints),
    Option("--concurrency", f"rollouts in flight (default {DEFAULT.concurrency})", int),
    Option("--max-batch", f"engine batch size (default {DEFAULT.max_batch})", int),
    Option("--turns", f"calls per rollout (default {DEFAULT.turns})", int),
    Option("--warmup", f"seconds before measuring (default {DEFAULT.warmup_s})", float, field="warmup_s"),
    Option(
        "--duration",
        f"seconds measured per trial (default {DEFAULT.measure_s})",
        float,
        field="measure_s",
    ),
    Option("--placement", "where TransferQueue runs (default separate)", choices=PLACEMENTS),
    Option("--threads", "torch threads for the model (default 1)", int),
    Option("--model-dir", "tiny model directory (built if missing)", Path, for_run=True),
    Option("--plot", "write throughput vs data-plane delay to this PNG", Path, for_run=True),
)


class CountingSink:
    """The event sink of the engine-side writer: events are counted, not shipped (the
    broker's cost is the pipeline benchmark's subject, not this one's)."""

    def __init__(self) -> None:
        self.published = 0

    async def publish(self, records: Sequence[Record]) -> None:
        self.published += len(records)


@dataclass(slots=True)
class Hooks:
    """One mode's hooks for one trial, and how to wind them down."""

    preparer: PromptPreparer | None = None
    stager: PayloadStager | None = None
    prefetch: Callable[[CaptureAdmission], Awaitable[object]] | None = None
    close: Callable[[], Awaitable[None]] | None = None
    failures: Callable[[], int] = lambda: 0


async def make_hooks(mode: Mode, plane: DataPlane) -> Hooks:
    """The capture hooks of ``mode`` over ``plane``, started on the running loop."""
    if mode == "off":
        return Hooks()
    if mode == "inline":
        from bench.inline_capture import InlineCapture

        inline = InlineCapture(plane)
        return Hooks(inline, inline, failures=lambda: sum(inline.stats.failed.values()))
    from stages.capture.cache import ChainCache
    from stages.capture.core import AckPolicy, CaptureCore
    from stages.capture.megatron.preparer import MegatronPromptPreparer
    from stages.capture.megatron.registry import PreparedCalls
    from stages.capture.megatron.stager import MegatronPayloadStager
    from stages.capture.resolve import PrefixResolver
    from stages.capture.writer import StagingWriter

    cache = ChainCache()
    writer = StagingWriter(plane, CountingSink(), worker_id="bench-engine")
    core = CaptureCore(
        PrefixResolver(plane, cache, wait_s=30.0, poll_s=0.005), writer, cache, ack_policy=AckPolicy.ENQUEUED
    )
    registry = PreparedCalls()
    preparer = MegatronPromptPreparer(core, registry, loop=asyncio.get_running_loop())
    stager = MegatronPayloadStager(core, registry)
    writer.start()
    stager.start()

    async def close() -> None:
        await stager.drain()
        await stager.stop()
        await writer.stop()

    def failures() -> int:
        return sum(stager.stats.failed.values()) + sum(writer.stats.failed.values())

    return Hooks(preparer, stager, preparer.prefetch, close, failures)


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


async def drive(
    engine: BatchEngine,
    hooks: Hooks,
    config: EngineConfig,
    *,
    index: int,
    budget: int,
    tag: str,
    vocab: int,
) -> None:
    """Rollouts back to back until cancelled: each turn's prompt is the exact previous ids
    plus new user tokens; with capture, the admission rides along as ``ng_capture``."""
    from stages.client import RolloutClient

    client = RolloutClient(CountingSink())
    capture = hooks.preparer is not None
    for number in range(1_000_000):
        rng = random.Random(f"{config.seed}/{index}/{number}")
        rollout_id = f"{tag}-{index}-{number}"
        ids = _tokens(rng, config.first_prompt, vocab)
        coords: CommitCoords | None = None
        for turn in range(config.turns):
            prompt = ids if turn == 0 else ids + _tokens(rng, config.user_tokens, vocab)
            # Stagger the very first call of each driver so that finishes spread over steps.
            tokens = 1 + index % budget if number == 0 and turn == 0 else budget
            params: dict[str, Any] | None = None
            if capture:
                admission = client.admit(rollout_id, coords)
                if hooks.prefetch is not None:
                    await hooks.prefetch(admission)
                params = RolloutClient.request_body({}, admission)
            reply = await asyncio.wrap_future(engine.submit(prompt, params, max_tokens=tokens))
            if capture:
                coords = RolloutClient.coords_from_reply(reply.metadata or {})
            ids = prompt + reply.generated


@dataclass(slots=True)
class Trial:
    """What one trial measured."""

    mode: Mode
    latency_ms: float
    finishing: int
    round: int
    tokens_per_s: float
    steps: list[float] = field(default_factory=list)  # step durations in the window, s
    hook_s: float = 0.0
    forward_s: float = 0.0
    calls: int = 0
    cpu_s: float = 0.0
    plane_cpu_s: float | None = None
    batch_mean: float = 0.0
    finished_per_step: float = 0.0
    capture_failed: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "latency_ms": self.latency_ms,
            "finishing": self.finishing,
            "round": self.round,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "steps": len(self.steps),
            "step_ms": {k: round(v * 1e3, 2) for k, v in percentiles(self.steps).items()},
            "hook_ms_per_step": round(self.hook_s / max(1, len(self.steps)) * 1e3, 3),
            "forward_ms_per_step": round(self.forward_s / max(1, len(self.steps)) * 1e3, 3),
            "calls": self.calls,
            "cpu_ms_per_call": round(self.cpu_s / max(1, self.calls) * 1e3, 3),
            "batch_mean": round(self.batch_mean, 2),
            "finished_per_step": round(self.finished_per_step, 2),
            "capture_failed": self.capture_failed,
        }


def window(steps: Sequence[StepRecord], begin: float, end: float) -> list[StepRecord]:
    """The steps that ended inside ``[begin, end]``."""
    return [s for s in steps if begin <= s.end <= end]


class Bench:
    """The model, the data plane and the loop shared by every trial of one run."""

    def __init__(self, config: EngineConfig, lm: CausalLM, plane: DataPlane) -> None:
        self.config = config
        self.lm = lm
        self.plane = plane
        self.count = 0
        # The data plane's owner process, when it is another one (placement "separate").
        pid = getattr(getattr(plane, "addresses", None), "pid", None)
        self.plane_pid: int | None = pid if isinstance(pid, int) and pid != os.getpid() else None

    async def trial(self, mode: Mode, latency_ms: float, finishing: int, round_: int) -> Trial:
        config = self.config
        self.count += 1
        tag = f"t{self.count}"
        plane = with_delay(self.plane, latency_ms / 1e3)
        hooks = await make_hooks(mode, plane)
        engine = BatchEngine(self.lm, max_batch=config.max_batch)
        engine.prompt_preparer, engine.payload_stager = hooks.preparer, hooks.stager
        budget = config.budget(finishing)
        runner = EngineThread(engine).start()
        drivers = [
            asyncio.create_task(
                drive(engine, hooks, config, index=i, budget=budget, tag=tag, vocab=self.lm.vocab_size)
            )
            for i in range(config.concurrency)
        ]
        try:
            await asyncio.sleep(config.warmup_s)
            begin, cpu, plane_cpu = time.perf_counter(), process_cpu_s(), self._plane_cpu()
            await asyncio.sleep(config.measure_s)
            end, cpu_end, plane_cpu_end = time.perf_counter(), process_cpu_s(), self._plane_cpu()
        finally:
            # Off the loop: an inline hook in the last step is waiting on this loop.
            await asyncio.to_thread(runner.stop)
            for task in drivers:
                task.cancel()
            for task in drivers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if hooks.close is not None:
                await hooks.close()
        if runner.error is not None:
            raise RuntimeError(f"the engine failed in mode {mode}") from runner.error
        for task in drivers:
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"a driver failed in mode {mode}") from task.exception()
        steps = window(engine.steps, begin, end)
        await self._clean()
        return Trial(
            mode,
            latency_ms,
            finishing,
            round_,
            tokens_per_s=sum(s.tokens for s in steps) / (end - begin),
            steps=[s.seconds for s in steps],
            hook_s=sum(s.hook_s for s in steps),
            forward_s=sum(s.forward_s for s in steps),
            calls=sum(s.finished for s in steps),
            cpu_s=(cpu_end or 0.0) - (cpu or 0.0),
            plane_cpu_s=None if plane_cpu is None or plane_cpu_end is None else plane_cpu_end - plane_cpu,
            batch_mean=statistics.fmean([s.batch for s in steps]) if steps else 0.0,
            finished_per_step=statistics.fmean([s.finished for s in steps]) if steps else 0.0,
            capture_failed=hooks.failures(),
        )

    def _plane_cpu(self) -> float | None:
        return None if self.plane_pid is None else process_cpu_s(self.plane_pid)

    async def _clean(self) -> None:
        """Drop the trial's rows (untimed) so the data plane does not grow across trials."""
        keys = await self.plane.list_keys(STAGING_PARTITION)
        for start in range(0, len(keys), 512):
            await self.plane.delete_calls(keys[start : start + 512])

    async def data_plane_ms(self, calls: int = 20) -> dict[str, float]:
        """The real data plane's single-row put and get latency, for the report."""
        from topics.digest import build_delta
        from topics.staging import staging_row

        delta = build_delta(list(range(3, 35)), list(range(40, 56)), [-0.5] * 16, 0)
        puts: list[float] = []
        gets: list[float] = []
        for i in range(calls):
            row = staging_row(
                rollout_id=f"probe-{i}",
                call_id="c0",
                parent_call_id=None,
                parent_chain_hash=None,
                prefix_ids=[],
                delta=delta,
                weight_version=0,
            )
            start = time.perf_counter()
            await self.plane.put_calls([row])
            puts.append(time.perf_counter() - start)
            start = time.perf_counter()
            await self.plane.get_calls([row.staging_key])
            gets.append(time.perf_counter() - start)
        await self._clean()
        return {
            "put_p50": round(percentiles(puts)["p50"] * 1e3, 2),
            "get_p50": round(percentiles(gets)["p50"] * 1e3, 2),
        }


def schedule(config: EngineConfig) -> list[tuple[int, float, int, Mode]]:
    """(round, latency, finishing, mode) in run order: rounds outermost, the modes of one
    cell back to back, their order rotated from cell to cell and round to round."""
    order: list[tuple[int, float, int, Mode]] = []
    cell = 0
    for round_ in range(config.trials):
        for finishing in config.finishing:
            for latency in config.latencies_ms:
                shift = (cell + round_) % len(MODES)
                for mode in MODES[shift:] + MODES[:shift]:
                    order.append((round_, latency, finishing, mode))
                cell += 1
    return order


def summarize(config: EngineConfig, trials: Sequence[Trial]) -> list[dict[str, Any]]:
    """Per (latency, finishing): each mode's median tokens/s and pooled step times, and
    the median over rounds of each capture mode's tokens/s over ``off`` in the same round."""
    cells: list[dict[str, Any]] = []
    for finishing in config.finishing:
        for latency in config.latencies_ms:
            mine = [t for t in trials if t.finishing == finishing and t.latency_ms == latency]
            modes = {mode: _mode_summary([t for t in mine if t.mode == mode]) for mode in MODES}
            ratios = {f"{mode}_over_off": _paired_ratio(mine, mode) for mode in ("tokentrail", "inline")}
            cells.append(
                {
                    "latency_ms": latency,
                    "injected": latency > 0,
                    "finishing": finishing,
                    "modes": modes,
                    **ratios,
                }
            )
    return cells


def _mode_summary(runs: Sequence[Trial]) -> dict[str, Any]:
    """One mode in one cell: per step (pooled over rounds) and per finished call."""
    steps = [s for t in runs for s in t.steps]
    count, calls = max(1, len(steps)), max(1, sum(t.calls for t in runs))
    plane = [t.plane_cpu_s for t in runs]
    return {
        "tokens_per_s": round(statistics.median(t.tokens_per_s for t in runs), 1),
        "step_ms": {k: round(v * 1e3, 2) for k, v in percentiles(steps).items()},
        "hook_ms_per_step": round(sum(t.hook_s for t in runs) / count * 1e3, 3),
        "forward_ms_per_step": round(sum(t.forward_s for t in runs) / count * 1e3, 3),
        "cpu_ms_per_call": round(sum(t.cpu_s for t in runs) / calls * 1e3, 3),
        "data_plane_cpu_ms_per_call": None
        if any(p is None for p in plane)
        else round(sum(p or 0.0 for p in plane) / calls * 1e3, 3),
        "capture_failed": sum(t.capture_failed for t in runs),
    }


def _paired_ratio(trials: Sequence[Trial], mode: Mode) -> float:
    ratios = []
    for round_ in {t.round for t in trials}:
        off = [t.tokens_per_s for t in trials if t.round == round_ and t.mode == "off"]
        on = [t.tokens_per_s for t in trials if t.round == round_ and t.mode == mode]
        if off and on and off[0] > 0:
            ratios.append(on[0] / off[0])
    return round(statistics.median(ratios), 3) if ratios else 0.0


async def run_async(config: EngineConfig, model_dir: Path) -> dict[str, Any]:
    from pipeline.models.tiny import make_tiny_model

    started = time.perf_counter()
    load_before = machine()["load_average"]
    lm = CausalLM(make_tiny_model(model_dir, seed=0), threads=config.threads)
    async with open_plane(config.placement) as plane:
        bench = Bench(config, lm, plane)
        probe = await bench.data_plane_ms()
        await bench.trial("off", 0.0, config.finishing[0], -1)  # warm the model and the allocator
        trials = [await bench.trial(mode, lat, fin, rnd) for rnd, lat, fin, mode in schedule(config)]
    cells = summarize(config, trials)
    worst = min((c["tokentrail_over_off"] for c in cells), default=0.0)
    return {
        "benchmark": "engine",
        "config": asdict(config),
        "machine": machine() | {"load_average_at_start": load_before},
        "versions": versions(),
        "data_plane_ms": probe,
        "cells": cells,
        "trials": [t.summary() for t in trials],
        "summary": {
            "tokentrail_over_off_min": worst,
            "tokentrail_over_off_median": round(
                statistics.median(c["tokentrail_over_off"] for c in cells), 3
            ),
            "inline_over_off_min": min((c["inline_over_off"] for c in cells), default=0.0),
            "target_ratio": TARGET_RATIO,
            "target_met": worst >= TARGET_RATIO,
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(
    config: EngineConfig | None = None,
    *,
    model_dir: Path | None = None,
    plot: Path | None = None,
) -> dict[str, Any]:
    """Run the sweep and return the report; ``plot`` also draws throughput vs latency."""
    config = config or EngineConfig()
    directory = model_dir or Path(tempfile.gettempdir()) / "tokentrail-bench-model"
    report = asyncio.run(run_async(config, directory))
    if plot is not None:
        from bench.plots import engine_throughput

        report["plot"] = str(engine_throughput(report, plot))
    return report


def render(report: dict[str, Any]) -> str:
    """The report as a table: tokens/s per mode, step p50/p99 and the ratios to ``off``."""
    probe = report["data_plane_ms"]
    lines = [
        f"data plane ({report['config']['placement']}): put p50 {probe['put_p50']} ms, "
        f"get p50 {probe['get_p50']} ms",
        "| delay | fin/step | tok/s off · inline · tokentrail | step p50/p99 ms off · inline · tokentrail "
        "| hook ms/step inline · tokentrail | inline/off | tokentrail/off |",
        "|---|---:|---|---|---|---:|---:|",
    ]
    for cell in report["cells"]:
        modes = cell["modes"]
        rates = " · ".join(f"{modes[m]['tokens_per_s']:,.0f}" for m in MODES)
        steps = " · ".join(
            f"{modes[m]['step_ms']['p50']:.0f}/{modes[m]['step_ms']['p99']:.0f}" for m in MODES
        )
        hooks = " · ".join(f"{modes[m]['hook_ms_per_step']:.1f}" for m in ("inline", "tokentrail"))
        delay = f"+{cell['latency_ms']:g} ms" if cell["injected"] else "real"
        lines.append(
            f"| {delay} | {cell['finishing']} | {rates} | {steps} | {hooks} | "
            f"{cell['inline_over_off']:.3f} | {cell['tokentrail_over_off']:.3f} |"
        )
    lines += [
        "",
        "| delay | fin/step | forward ms/step off · inline · tokentrail | CPU ms per finished call, engine "
        "process off · inline · tokentrail | data-plane process |",
        "|---|---:|---|---|---|",
    ]
    for cell in report["cells"]:
        modes = cell["modes"]
        delay = f"+{cell['latency_ms']:g} ms" if cell["injected"] else "real"
        forward = " · ".join(f"{modes[m]['forward_ms_per_step']:.1f}" for m in MODES)
        cpu = " · ".join(f"{modes[m]['cpu_ms_per_call']:.2f}" for m in MODES)
        plane = " · ".join(
            "–"
            if modes[m]["data_plane_cpu_ms_per_call"] is None
            else f"{modes[m]['data_plane_cpu_ms_per_call']:.2f}"
            for m in MODES
        )
        lines.append(f"| {delay} | {cell['finishing']} | {forward} | {cpu} | {plane} |")
    summary = report["summary"]
    lines.append(
        f"tokentrail/off: min {summary['tokentrail_over_off_min']:.3f}, median "
        f"{summary['tokentrail_over_off_median']:.3f} (target >= {summary['target_ratio']}); "
        f"inline/off min {summary['inline_over_off_min']:.3f}"
    )
    return "\n".join(lines)


BENCHMARK = Benchmark("engine", __doc__, DEFAULT, QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
