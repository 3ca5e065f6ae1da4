"""What a run reports: live counters while it runs, and the summary at the end.

``RunProgress`` is written by the orchestrator and read by the live display (from its
refresh thread: plain counters, no locking needed for a progress view).
``RunSummary`` is the final account; its ``document()`` is the ``--json`` output.

``tokens_captured`` is the sum of ``total_len`` over this run's accepted
``FinalizedEvent``s, i.e. the prompt plus generated tokens of every accepted sample
(equal to the summed ``len(token_ids)`` of the archived samples);
``generated_tokens`` is the loss-masked (mask 1) part of it. ``retokenization`` counts
the archived generated turns a decode → re-encode would have changed (``samples.drift``):
what keeping the sampled ids saved this run.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.samples.drift import Drift
from stages.driver import DriverStats
from topics.records import FinalizedEvent

log = logging.getLogger(__name__)

RunStatus = Literal["completed", "interrupted", "timeout", "failed"]
MISSING_LISTED = 20  # the JSON names at most this many rollouts without an outcome


@dataclass(slots=True)
class RunProgress:
    """Live counters of one run."""

    run_id: str = ""
    rollouts: int = 0
    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)
    driving_since: float | None = None
    driving_until: float | None = None
    driver: DriverStats = field(default_factory=DriverStats)
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    samples_written: int = 0
    lag: dict[str, int] = field(default_factory=dict)

    @property
    def finalized(self) -> int:
        return self.accepted + sum(self.rejected.values())

    def record(self, event: FinalizedEvent) -> None:
        if event.status == "accepted":
            self.accepted += 1
        else:
            self.rejected[str(event.rejection_reason)] += 1

    def enter(self, phase: str) -> None:
        """Move to ``phase``, and say so in the log (an operator sees where a run is)."""
        self.phase = phase
        log.info("run %s: %s", self.run_id, phase)

    def calls_per_s(self, now: float | None = None) -> float:
        if self.driving_since is None:
            return 0.0
        end = self.driving_until if self.driving_until is not None else (now or time.monotonic())
        elapsed = end - self.driving_since
        return self.driver.calls / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The account of one run; ``exit_code`` is what ``tokentrail run`` exits with."""

    status: RunStatus
    run_id: str
    rollouts: int
    group_size: int
    turns: int
    max_tokens: int
    temperature: float
    sampling: dict[str, Any]
    """What every call sent (``RunConfig.sampling``); the engine may add its model's defaults."""
    seed: int
    finalized: int
    accepted: int
    rejected: dict[str, int]
    missing: list[str]
    calls: int
    capture_failed: int
    broken: int
    tokens_captured: int
    generated_tokens: int
    samples_written: int
    samples_file: str
    data_dir: str
    model_dir: str
    bootstrap: str | None
    dataplane_mode: str
    dataplane_addresses: str | None
    worker_url: str | None
    agent: str
    gateway_url: str | None
    lag: int | None
    lag_by_stage: dict[str, int]
    elapsed_s: float
    drive_s: float | None
    signal: int | None = None
    error: str | None = None
    closed_interrupted: int = 0
    """Rollouts of earlier, killed runs this run sealed as interrupted."""
    train_steps: list[dict[str, Any]] | None = None
    """``--train-steps``: one object per step (``pipeline.run.training.TrainStep``)."""
    dataplane_samples_left: int | None = None
    """``--train-steps``: samples still in the data plane at the end (0: all consumed)."""
    paced_waits: int | None = None
    """Rollouts held back until the trainer caught up: by the paced closed loop
    (``--max-staleness``), or by a paced gateway's 429 the agent waited out; None: not paced."""
    stages: str | None = None
    """How the run hosted its stages (``processes`` or ``inline``); None: the cluster's (drive)."""
    retokenization: Drift | None = None
    """Generated turns archived and those a re-tokenization would change; None: no local tokenizer."""

    @property
    def exit_code(self) -> int:
        if self.status == "completed":
            return 0
        if self.status == "interrupted" and self.signal is not None:
            return 128 + self.signal
        return 1

    @property
    def calls_per_s(self) -> float | None:
        if not self.drive_s:
            return None
        return self.calls / self.drive_s

    def document(self) -> dict[str, Any]:
        """The ``--json`` document (stable keys; see DESIGN §10 for the required ones)."""
        return {
            "status": self.status,
            "run_id": self.run_id,
            "rollouts": self.rollouts,
            "group_size": self.group_size,
            "turns": self.turns,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "sampling": self.sampling,
            "seed": self.seed,
            "finalized": self.finalized,
            "accepted": self.accepted,
            "rejected": dict(sorted(self.rejected.items())),
            "missing": len(self.missing),
            "missing_rollouts": self.missing[:MISSING_LISTED],
            "calls": self.calls,
            "capture_failed": self.capture_failed,
            "broken_rollouts": self.broken,
            "tokens_captured": self.tokens_captured,
            "generated_tokens": self.generated_tokens,
            "samples_written": self.samples_written,
            "samples_file": self.samples_file,
            "data_dir": self.data_dir,
            "model_dir": self.model_dir,
            "bootstrap": self.bootstrap,
            "dataplane_mode": self.dataplane_mode,
            "dataplane_addresses": self.dataplane_addresses,
            "worker_url": self.worker_url,
            "agent": self.agent,
            "gateway_url": self.gateway_url,
            "lag": self.lag,
            "lag_by_stage": self.lag_by_stage,
            "elapsed_s": round(self.elapsed_s, 3),
            "drive_s": None if self.drive_s is None else round(self.drive_s, 3),
            "calls_per_s": None if self.calls_per_s is None else round(self.calls_per_s, 2),
            "signal": None if self.signal is None else signal.Signals(self.signal).name,
            "error": self.error,
            "closed_interrupted": self.closed_interrupted,
            "paced_waits": self.paced_waits,
            "retokenization": None if self.retokenization is None else self.retokenization.document(),
            **({"stages": self.stages} if self.stages is not None else {}),
            **(
                {"train_steps": self.train_steps, "dataplane_samples_left": self.dataplane_samples_left}
                if self.train_steps is not None
                else {}
            ),
        }


def outcome_totals(events: list[FinalizedEvent]) -> tuple[int, int]:
    """(tokens_captured, generated_tokens) over the accepted events."""
    accepted = [event for event in events if event.status == "accepted"]
    return sum(event.total_len for event in accepted), sum(event.generated_tokens for event in accepted)
