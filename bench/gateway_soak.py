"""Gateway soak: the real ``tokentrail gateway`` under steady agent load for minutes or hours.

``bench.soak`` has no gateway (its driver calls the capture core), so what the gateway keeps
per rollout, session or api key is measured here: the cluster of ``bench.fronted`` (one
``tokentrail worker`` on the vLLM CPU engine with the tiny model, an embedded broker, a
``tokentrail dataplane``) with one ``tokentrail gateway`` in front. ``--agents``
agents each loop: open a rollout through the gateway, make ``--calls`` short chat completions
through the official ``openai`` SDK (each continuing the conversation, so the gateway links
child calls), seal. Every ``--sample-every`` seconds the gateway's, the worker's (its API
process; the engine core apart) and the data plane's resident memory, and the gateway's open
sessions. The gateway's one bound per finished rollout, the sealed sessions it remembers, is
set small (``--remember-sealed``), so it is full within the first minute and any growth after
that is a leak, not a structure still filling (at its default of 10,000, a run of a few
rollouts a second fills it for most of an hour). The report is ``bench.soak``'s memory
slope per 10,000 finished rollouts (least squares) over the samples past the first third,
and over each half of the run apart: a process is flat when its second half's slope is
near 0 and below its first's.

    tokentrail bench gateway-soak [--quick] [--json] [--minutes 30] [--agents 8]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from bench.command import Benchmark, Option, Quick
from bench.common import machine
from bench.fronted import fronted, open_rollout, seal
from bench.soak import RSS_COLUMNS, rss_report, rss_row
from pipeline.process.guard import guard_descendants

ERRORS_KEPT = 5
"""The first few failed rollouts' errors go into the report; the rest are only counted."""


@dataclass(frozen=True, slots=True)
class GatewaySoakConfig:
    minutes: float = 30.0
    sample_every_s: float = 5.0
    agents: int = 8
    """Agents playing rollouts at once, each one rollout at a time."""
    calls: int = 2
    """Chat completions per rollout."""
    tokens: int = 4
    """Generated tokens per call: short, so the run measures the gateway, not the engine."""
    remember_sealed: int = 300
    """The gateway's ``--remember-sealed``."""

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.sample_every_s <= 0:
            raise ValueError("--minutes and --sample-every: must be > 0")
        if min(self.agents, self.calls, self.tokens, self.remember_sealed) < 1:
            raise ValueError("--agents, --calls, --tokens and --remember-sealed: must be >= 1")


QUICK = Quick("a 1-minute soak, sampled every 3 s", GatewaySoakConfig(minutes=1.0, sample_every_s=3.0))
OPTIONS = (
    Option("--minutes", "how long the load runs (default 30)", float),
    Option("--sample-every", "seconds between samples (default 5)", float, field="sample_every_s"),
    Option("--agents", "agents playing rollouts at once (default 8)", int),
    Option("--calls", "chat completions per rollout (default 2)", int),
    Option("--tokens", "generated tokens per call (default 4)", int),
    Option("--remember-sealed", "the gateway's sealed sessions kept (default 300)", int),
)


def run(config: GatewaySoakConfig) -> dict[str, Any]:
    guard_descendants()  # the cluster's processes die with this one, also on SIGTERM or SIGKILL
    with tempfile.TemporaryDirectory(prefix="gateway-soak-") as scratch, fronted(Path(scratch)) as cluster:
        gateway, url = cluster.gateway(remember_sealed=config.remember_sealed)
        pids = {"gateway": gateway.pid, "worker": cluster.worker.pid, "dataplane": cluster.dataplane.pid}
        tally: Counter[str] = Counter()
        errors: list[str] = []
        samples = asyncio.run(_drive(config, url, cluster.environment, cluster.model, pids, tally, errors))
    return _report(config, samples, tally, errors)


async def _drive(
    config: GatewaySoakConfig,
    url: str,
    environment: dict[str, str],
    model: str,
    pids: dict[str, int],
    tally: Counter[str],
    errors: list[str],
) -> list[dict[str, Any]]:
    """The agents for ``config.minutes``, sampled as they go; they finish the rollout in hand."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, headers=environment, timeout=120) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key="per-rollout", timeout=120)
        agents = [
            asyncio.create_task(_agent(http, client, model, config, stop, tally, errors))
            for _ in range(config.agents)
        ]
        samples: list[dict[str, Any]] = []
        began = time.monotonic()
        while time.monotonic() - began < config.minutes * 60 and not any(a.done() for a in agents):
            await asyncio.sleep(config.sample_every_s)
            samples.append(
                {
                    "at_s": round(time.monotonic() - began, 1),
                    "finished": tally["finished"],
                    "failed": tally["failed"],
                    "rss_mib": _rss_mib(pids),
                    "open_sessions": await _open_sessions(http),
                }
            )
        stop.set()
        await asyncio.gather(*agents)  # an agent that died raises here
        await client.close()
    return samples


async def _agent(
    http: httpx.AsyncClient,
    client: openai.AsyncOpenAI,
    model: str,
    config: GatewaySoakConfig,
    stop: asyncio.Event,
    tally: Counter[str],
    errors: list[str],
) -> None:
    """Rollouts one after another until ``stop``; a failed one is counted and left to the
    gateway's session TTL, as a crashed agent's would be."""
    while not stop.is_set():
        try:
            opened = await open_rollout(http)
            agent = client.with_options(base_url=opened["base_url"], api_key=opened["api_key"])
            messages: list[ChatCompletionMessageParam] = []
            for number in range(config.calls):
                messages.append({"role": "user", "content": f"Step {number}."})
                reply = await agent.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=config.tokens,
                    extra_body={"min_tokens": config.tokens, "ignore_eos": True},
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            await seal(http, opened)
        except (openai.APIError, httpx.HTTPError) as exc:
            tally["failed"] += 1
            if len(errors) < ERRORS_KEPT:
                errors.append(f"{type(exc).__name__}: {exc}")
            continue
        tally["finished"] += 1


def _rss_mib(pids: dict[str, int]) -> dict[str, float]:
    """Resident MiB per process, and of the worker's engine core (its descendants) apart."""
    rss = {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}
    rss["engine_core"] = sum(
        child.memory_info().rss for child in psutil.Process(pids["worker"]).children(recursive=True)
    )
    return {name: round(value / 2**20, 2) for name, value in rss.items()}


async def _open_sessions(http: httpx.AsyncClient) -> int:
    """The gateway's sessions not sealed yet, from its ``/metrics``."""
    text = (await http.get("/metrics")).raise_for_status().text
    return next(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokentrail_gateway_open_sessions"
    )


def _report(
    config: GatewaySoakConfig, samples: list[dict[str, Any]], tally: Counter[str], errors: list[str]
) -> dict[str, Any]:
    last = samples[-1]
    steady = samples[len(samples) // 3 :]
    return {
        "benchmark": "gateway-soak",
        "config": asdict(config),
        "rollouts": last["finished"],
        "calls": last["finished"] * config.calls,
        "failed": tally["failed"],
        "errors": errors,
        "rollouts_per_s": round(last["finished"] / last["at_s"], 2),
        "steady_from_rollouts": steady[0]["finished"],
        "open_sessions_max": max(s["open_sessions"] for s in samples),
        "processes": {name: rss_report(samples, steady, name) for name in last["rss_mib"]},
        "samples": samples,
        "machine": machine(),
    }


def render(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = [
        f"gateway soak {config['minutes']:g} min, {config['agents']} agents x {config['calls']} calls: "
        f"{report['rollouts']} rollouts ({report['failed']} failed), {report['rollouts_per_s']}/s; "
        f"open sessions max {report['open_sessions_max']}; slopes (MiB per 10k rollouts) over the "
        f"samples from {report['steady_from_rollouts']} rollouts on, and over each half of the run",
        RSS_COLUMNS,
    ]
    lines += [rss_row(name, process) for name, process in report["processes"].items()]
    lines += [f"error: {error}" for error in report["errors"]]
    return "\n".join(lines)


BENCHMARK = Benchmark("gateway-soak", __doc__, GatewaySoakConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
