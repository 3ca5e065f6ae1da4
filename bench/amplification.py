"""Fail-closed amplification: how many rollouts a lost call costs.

Upstream systems mask a whole rollout when any one of its calls was lost (fail closed),
so at 64 calls per rollout a 0.6% call-loss rate masks about a third of all rollouts.
tokentrail drops a failed call that the driver retried (a dead branch off the terminal
chain) and rejects a rollout only when the failure lies on the chain that becomes the
sample. This measures the difference end to end, on the real code: admissions and
seals from ``RolloutClient``, capture through ``CaptureCore`` (prefix resolution,
chain cache, background ``StagingWriter``) on in-memory ports, then the recorded
events through ``LedgerStage`` and its receipts through ``FinalizerStage``.

Failure model: a rollout has ``calls`` turns; every call attempt is lost (the engine
never serves it: ``CaptureCore.fail`` with ``not_served``) independently with
probability ``fail``. A lost call is retried once with a new admission from the same
parent; if the retry is lost too the episode ends there and is sealed with its reward
anyway, so its terminal chain was hit. The driver keeps that ground truth, and the
exact ids of the chain that survived, to check every outcome against. A verdict or
sample that contradicts it is printed on stderr and the command exits 1.

    tokentrail bench amplification [--quick] [--json] [--rollouts N]
        [--calls 16,64] [--fail 0.006,0.01] [--seed 0]

Without ``--calls`` and ``--fail`` it measures the default configurations (500 / 500 /
1,000 rollouts, or ``--rollouts`` each); with either, their grid (64 calls and 1% when
one is left out, 1,000 rollouts unless ``--rollouts``).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.command import Benchmark, Option, Quick, floats, ints
from bench.common import machine
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed
from topics.events import envelope
from topics.failures import WorkerFailure
from topics.records import FinalizedEvent, Record, RolloutReceipt

LOST = WorkerFailure.NOT_SERVED
"""How a lost call reaches the ledger: the worker reports the admitted call as never served."""

PROMPT_TOKENS = 4
GENERATED_TOKENS = 4
CHUNK = 250
"""Rollouts captured per round before their events go through the stages (bounds memory)."""


@dataclass(frozen=True, slots=True)
class Config:
    """One measured configuration: turns per rollout, per-attempt loss probability, rollouts."""

    calls: int
    fail: float
    rollouts: int

    @property
    def label(self) -> str:
        return f"{self.calls} calls, {self.fail:.1%} failing"


DEFAULT_CONFIGS = (Config(64, 0.006, 500), Config(64, 0.01, 500), Config(16, 0.01, 1000))
"""Sized for about a minute on two cores (about 1,300 calls/s end to end); ``--rollouts`` for more."""


@dataclass(frozen=True, slots=True)
class AmplificationConfig:
    """What one run measures: the default configurations, or the ``calls`` x ``fail`` grid."""

    calls: tuple[int, ...] = ()
    fail: tuple[float, ...] = ()
    rollouts: int | None = None
    """Rollouts per configuration; unset: the defaults' own, 1,000 for a grid."""
    seed: int = 0

    def __post_init__(self) -> None:
        if any(not 0.0 <= fail < 1.0 for fail in self.fail):
            raise ValueError(f"fail: each must be in [0, 1), got {self.fail}")
        if self.rollouts is not None and self.rollouts < 1:
            raise ValueError(f"rollouts: must be >= 1, got {self.rollouts}")

    def configs(self) -> list[Config]:
        if not self.calls and not self.fail:
            if self.rollouts is None:
                return list(DEFAULT_CONFIGS)
            return [Config(c.calls, c.fail, self.rollouts) for c in DEFAULT_CONFIGS]
        return [
            Config(c, f, self.rollouts or 1000) for c in self.calls or (64,) for f in self.fail or (0.01,)
        ]


QUICK = Quick("100 rollouts per default configuration", AmplificationConfig(rollouts=100))
OPTIONS = (
    Option(
        "--rollouts",
        "rollouts per configuration (defaults: 500 at 64 calls, 1000 at 16; 1000 for a grid)",
        int,
    ),
    Option("--calls", "turns per rollout, comma separated (default 64)", ints),
    Option("--fail", "per-attempt loss probabilities, comma separated (default 0.01)", floats),
    Option("--seed", "seed of the losses and the tokens (default 0)", int),
)


@dataclass(slots=True)
class Truth:
    """What the driver knows about one rollout, to judge the stages' verdict against."""

    rollout_id: str
    attempts: int = 0
    failed: list[str] = field(default_factory=list)
    chain: list[str] = field(default_factory=list)
    """Call ids of the served chain, root first: the calls the sample must consist of."""
    ids: list[int] = field(default_factory=list)
    """The exact ids of that chain (prompts and generations): what the sample must hold."""
    terminal_hit: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """One rollout: the driver's ground truth next to what the finalizer decided."""

    rollout_id: str
    attempts: int
    failed_calls: tuple[str, ...]
    terminal_hit: bool
    status: str
    reason: str | None
    sample_calls: tuple[str, ...]
    """Call ids of the accepted sample's spans (empty when rejected)."""
    sample_exact: bool
    """Accepted: the sample is exactly the served chain (its calls and ids). Rejected: no sample."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """All outcomes of one configuration, and what they add up to."""

    config: Config
    seed: int
    outcomes: list[Outcome]
    seconds: float
    rows_left: int
    """Staging rows still in the data plane after every rollout was finalized (should be 0)."""

    @property
    def rollouts(self) -> int:
        return len(self.outcomes)

    @property
    def calls(self) -> int:
        return sum(o.attempts for o in self.outcomes)

    @property
    def failed_calls(self) -> int:
        return sum(len(o.failed_calls) for o in self.outcomes)

    @property
    def any_failed(self) -> int:
        """Rollouts a fail-closed system masks: any lost call at all."""
        return sum(1 for o in self.outcomes if o.failed_calls)

    @property
    def terminal_hit(self) -> int:
        return sum(1 for o in self.outcomes if o.terminal_hit)

    @property
    def rejected(self) -> int:
        return sum(1 for o in self.outcomes if o.status == "rejected")

    @property
    def survived(self) -> int:
        """Rollouts rightly accepted although a call was lost: chain intact, sample exact."""
        return sum(
            1
            for o in self.outcomes
            if o.failed_calls and o.status == "accepted" and not o.terminal_hit and o.sample_exact
        )

    @property
    def reasons(self) -> Counter[str]:
        return Counter(str(o.reason) for o in self.outcomes if o.status == "rejected")

    @property
    def wrongly_rejected(self) -> list[str]:
        return [o.rollout_id for o in self.outcomes if o.status == "rejected" and not o.terminal_hit]

    @property
    def wrongly_accepted(self) -> list[str]:
        return [o.rollout_id for o in self.outcomes if o.status == "accepted" and o.terminal_hit]

    @property
    def inexact(self) -> list[str]:
        return [o.rollout_id for o in self.outcomes if not o.sample_exact]

    def share(self, count: int) -> float:
        return count / self.rollouts if self.rollouts else 0.0

    def summary(self) -> dict[str, Any]:
        """Counts, shares and the analytic expectations beside them, plus every disagreement by id."""
        c = self.config
        return {
            "calls_per_rollout": c.calls,
            "fail": c.fail,
            "seed": self.seed,
            "rollouts": self.rollouts,
            "calls": self.calls,
            "failed_calls": self.failed_calls,
            "any_failed": self.any_failed,
            "any_failed_share": self.share(self.any_failed),
            "fail_closed_expected_share": 1 - (1 - c.fail) ** c.calls,
            "terminal_hit": self.terminal_hit,
            "terminal_hit_share": self.share(self.terminal_hit),
            "terminal_hit_expected_share": 1 - (1 - c.fail**2) ** c.calls,
            "rejected": self.rejected,
            "rejected_share": self.share(self.rejected),
            "survived": self.survived,
            "reasons": dict(sorted(self.reasons.items())),
            "wrongly_rejected": self.wrongly_rejected,
            "wrongly_accepted": self.wrongly_accepted,
            "inexact_samples": self.inexact,
            "rows_left": self.rows_left,
            "seconds": round(self.seconds, 2),
        }


class _Pipeline:
    """The ledger and finalizer stages on in-memory ports, fed like the consumer loop would."""

    def __init__(self, plane: MemoryDataPlane) -> None:
        self.plane = plane
        self.ledger_out = RecordingSink()
        self.final_out = RecordingSink()
        self.ledger = LedgerStage(self.ledger_out, LedgerConfig(seal_grace_s=3600.0))
        self.finalizer = FinalizerStage(plane, self.final_out)
        self._offset = 0

    def _consumed(self, topic: str, records: Sequence[Record]) -> list[Consumed]:
        first, self._offset = self._offset, self._offset + len(records)
        return [Consumed(topic, 0, first + i, envelope(r)) for i, r in enumerate(records)]

    async def run(self, events: Sequence[Record], batch: int = 512) -> list[FinalizedEvent]:
        """Events in publication order through the ledger, its receipts through the finalizer."""
        for start in range(0, len(events), batch):
            await self.ledger.handle(self._consumed("events", events[start : start + batch]))
        receipts = self.ledger_out.payloads(RolloutReceipt)
        self.ledger_out.events.clear()
        for start in range(0, len(receipts), 64):
            await self.finalizer.handle(self._consumed("committed", receipts[start : start + 64]))
        finalized = [p for p in self.final_out.payloads(FinalizedEvent) if isinstance(p, FinalizedEvent)]
        self.final_out.events.clear()
        return finalized


async def _capture_chunk(
    ids: Sequence[str], config: Config, plane: MemoryDataPlane, fail_rng: random.Random, tok: random.Random
) -> tuple[list[Record], dict[str, Truth]]:
    """Drive ``ids`` through the real capture path; returns every published event and the truth."""
    sink, cache = RecordingSink(), ChainCache()
    writer = StagingWriter(plane, sink, worker_id="amplification", batch_delay_s=0.0)
    core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
    client = RolloutClient(sink)
    truths: dict[str, Truth] = {}
    writer.start()
    for rollout_id in ids:
        truth = truths[rollout_id] = Truth(rollout_id)
        coords = None
        for turn in range(config.calls):
            prompt = truth.ids + [tok.randrange(3, 50_000) for _ in range(PROMPT_TOKENS)]
            for attempt in range(2):
                call_id = f"t{turn}a{attempt}"
                admission = client.admit(rollout_id, coords, group_id="amp", call_id=call_id)
                await client.publish_admission(admission)
                prepared = await core.prepare(admission)
                truth.attempts += 1
                if fail_rng.random() < config.fail:
                    core.fail(prepared, LOST, weight_version=0)
                    truth.failed.append(call_id)
                    continue
                output = [tok.randrange(3, 50_000) for _ in range(GENERATED_TOKENS)]
                logprobs = [-tok.random() * 4 for _ in range(GENERATED_TOKENS)]
                coords = core.complete(prepared, prompt, output, logprobs, weight_version=0).coords
                if coords.disposition != "staged":
                    raise RuntimeError(f"{rollout_id}/{call_id}: capture failed: {coords.failure_reason}")
                truth.chain.append(call_id)
                truth.ids = prompt + output
                break
            else:  # the retry was lost too: the episode ends on a lost call
                truth.terminal_hit = True
                break
        await client.seal(rollout_id, group_id="amp", reward=1.0)
        await asyncio.sleep(0)  # the writer drains its queue (at most 4,096 rows) between rollouts
    await writer.stop()
    return [e.payload for e in sink.events], truths


def _outcome(truth: Truth, event: FinalizedEvent | None, plane: MemoryDataPlane) -> Outcome:
    sample = plane.samples.pop(truth.rollout_id, None)
    status = "missing" if event is None else event.status
    reason = None if event is None or event.rejection_reason is None else str(event.rejection_reason)
    sample_calls = tuple(span.call_id for span in sample.spans) if sample is not None else ()
    if status == "accepted":
        exact = sample is not None and list(sample_calls) == truth.chain and sample.token_ids == truth.ids
    else:
        exact = sample is None
    return Outcome(
        truth.rollout_id,
        truth.attempts,
        tuple(truth.failed),
        truth.terminal_hit,
        status,
        reason,
        sample_calls,
        exact,
    )


async def measure(config: Config, seed: int = 0) -> Measurement:
    """Capture, ledger and finalize ``config.rollouts`` rollouts; one outcome per rollout."""
    started = time.perf_counter()
    plane = MemoryDataPlane()
    pipeline = _Pipeline(plane)
    fail_rng, tok = random.Random(seed), random.Random(seed + 1_000_003)
    tag = f"amp{config.calls}-{config.fail:g}-s{seed}".replace(".", "p")
    outcomes: list[Outcome] = []
    for start in range(0, config.rollouts, CHUNK):
        ids = [f"{tag}-{n}" for n in range(start, min(start + CHUNK, config.rollouts))]
        events, truths = await _capture_chunk(ids, config, plane, fail_rng, tok)
        finalized = {e.rollout_id: e for e in await pipeline.run(events)}
        outcomes += [_outcome(truths[r], finalized.get(r), plane) for r in ids]
    if pipeline.ledger.open:
        raise RuntimeError(f"{len(pipeline.ledger.open)} rollout(s) never got a receipt")
    return Measurement(config, seed, outcomes, time.perf_counter() - started, len(plane.calls))


def run(config: AmplificationConfig = AmplificationConfig()) -> dict[str, Any]:
    """Each configuration on a fresh event loop and data plane, so none sees another's state."""
    measurements = [asyncio.run(measure(c, config.seed)) for c in config.configs()]
    return {
        "benchmark": "amplification",
        "machine": machine(),
        "results": [m.summary() for m in measurements],
    }


def render(report: dict[str, Any]) -> str:
    """One row per configuration; shares with their counts in brackets."""
    lines = [
        "| L | p | rollouts | calls | lost | fail-closed | chain hit | rejected | saved | reasons | wrong |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in report["results"]:
        wrong = len(r["wrongly_rejected"]) + len(r["wrongly_accepted"]) + len(r["inexact_samples"])
        reasons = ", ".join(f"{k} {v}" for k, v in r["reasons"].items()) or "-"
        lines.append(
            f"| {r['calls_per_rollout']} | {r['fail']:.1%} | {r['rollouts']:,} | {r['calls']:,} "
            f"| {r['failed_calls']:,} | {r['any_failed_share']:.1%} ({r['any_failed']}) "
            f"| {r['terminal_hit_share']:.2%} ({r['terminal_hit']}) | {r['rejected_share']:.2%} ({r['rejected']}) "
            f"| {r['survived']:,} | {reasons} | {wrong} |"
        )
    lines.append(
        "\nfail-closed: rollouts with any lost call (what upstream masks); chain hit: the episode "
        "ended on a lost call (driver's truth); saved: rightly accepted despite a lost call; "
        "wrong: verdicts or samples that disagree with the truth"
    )
    return "\n".join(lines)


def disagreements(report: dict[str, Any]) -> list[str]:
    """One line per kind of verdict that contradicts the driver's truth (none when all agree)."""
    lines: list[str] = []
    for r in report["results"]:
        label = Config(r["calls_per_rollout"], r["fail"], r["rollouts"]).label
        for what, ids in (
            ("accepted although the terminal chain was hit", r["wrongly_accepted"]),
            ("rejected although the terminal chain was intact", r["wrongly_rejected"]),
            ("sample is not exactly the served chain", r["inexact_samples"]),
        ):
            if ids:
                lines.append(f"{label}: {len(ids)} {what}, e.g. {', '.join(ids[:3])}")
    return lines


BENCHMARK = Benchmark(
    "amplification", __doc__, AmplificationConfig(), QUICK, OPTIONS, run, render, failures=disagreements
)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
