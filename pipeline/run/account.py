"""A run's account: what it found out as it went, and the summary it reports at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.run.cluster import RunContext, Services
from pipeline.run.report import RunStatus, RunSummary, outcome_totals
from pipeline.run.training_loop import TrainingLoop
from pipeline.samples.archive import archive_path, read_archive
from pipeline.samples.drift import Drift, drift_of, model_tokenizer
from stages.driver import Job


@dataclass(slots=True)
class RunAccount:
    """Written by the run as it goes; read by its summary, whenever that is asked for."""

    completed: bool = False
    """Every rollout finalized, every accepted sample archived, lag 0."""
    timeout: str | None = None
    error: str | None = None
    lag_by_stage: dict[str, int] = field(default_factory=dict)
    samples_left: int | None = None
    """Samples still in the data plane after training (None: no training)."""


@dataclass(frozen=True, slots=True)
class RunParts:
    """The run and the parts it had started (None: it stopped before that part)."""

    run: RunContext
    jobs: list[Job]
    services: Services | None
    training: TrainingLoop | None

    @property
    def model_dir(self) -> Path:
        config = self.run.config
        return self.services.model_dir if self.services is not None else config.resolved_model_dir


def run_status(parts: RunParts, account: RunAccount) -> RunStatus:
    shutdown = parts.run.shutdown
    if account.completed and account.error is None and shutdown.failure is None:
        return "completed"  # a signal while --keep served a finished run is the normal stop
    if shutdown.signal is not None:
        return "interrupted"
    if account.error is not None or shutdown.failure is not None:
        return "failed"
    if account.timeout is not None:
        return "timeout"
    return "failed"


def summarize(parts: RunParts, account: RunAccount) -> RunSummary:
    """The run's summary from its parts and its account, as far as the run got."""
    run, services = parts.run, parts.services
    config, progress, shutdown = run.config, run.progress, run.shutdown
    outcomes = services.outcomes if services is not None else None
    events = list(outcomes.watcher.events.values()) if outcomes is not None else []
    tokens, generated = outcome_totals(events)
    accepted = sum(1 for event in events if event.status == "accepted")
    stats = progress.driver
    drive_s = None
    if progress.driving_since is not None:
        drive_s = (progress.driving_until or time.monotonic()) - progress.driving_since
    written = outcomes.archiver.written if outcomes is not None else 0
    status = run_status(parts, account)
    if status == "completed" and written != sum(len(event.sample_keys) for event in events):
        status = "failed"
    errors = [e for e in (account.error, shutdown.failure, account.timeout) if e]
    if outcomes is not None and outcomes.archiver.failed:
        errors.append(f"{len(outcomes.archiver.failed)} sample(s) could not be archived")
    lag = account.lag_by_stage or progress.lag
    return RunSummary(
        status=status,
        run_id=run.run_id,
        rollouts=len(parts.jobs),
        group_size=config.group_size,
        turns=config.turns,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        sampling=config.sampling,
        seed=config.seed,
        finalized=len(events),
        accepted=accepted,
        rejected=dict(outcomes.watcher.rejected) if outcomes is not None else {},
        missing=outcomes.watcher.missing if outcomes is not None else [j.rollout_id for j in parts.jobs],
        calls=stats.calls,
        capture_failed=stats.capture_failed,
        broken=stats.broken,
        tokens_captured=tokens,
        generated_tokens=generated,
        samples_written=written,
        samples_file=str(archive_path(config.data_dir)),
        data_dir=str(config.data_dir),
        model_dir=str(parts.model_dir) if config.attach is None else (config.attach.model or ""),
        bootstrap=(services.kafka if services is not None else config.kafka).bootstrap_servers,
        dataplane_mode=config.dataplane_mode,
        dataplane_addresses=services.dataplane_addresses if services is not None else None,
        worker_url=services.worker_url if services is not None else None,
        agent=config.agent,
        gateway_url=services.gateway_url if services is not None else None,
        lag=sum(lag.values()) if lag else None,
        lag_by_stage=dict(lag),
        elapsed_s=time.monotonic() - progress.started,
        drive_s=drive_s,
        signal=shutdown.signal,
        error="; ".join(errors) or None,
        closed_interrupted=outcomes.closed_interrupted if outcomes is not None else 0,
        train_steps=parts.training.steps() if parts.training is not None else None,
        dataplane_samples_left=account.samples_left,
        paced_waits=_paced_waits(parts),
        stages=config.stages if config.attach is None else None,
        retokenization=_retokenization(parts),
    )


def _paced_waits(parts: RunParts) -> int | None:
    """Rollouts held back by the paced loop or a paced gateway; None when nothing paced."""
    paced = parts.run.progress.driver.paced
    gate = parts.training.paced_waits() if parts.training is not None else None
    if gate is not None:
        return paced + gate
    return paced or None


def _retokenization(parts: RunParts) -> Drift | None:
    """The drift over this run's archived samples, read with the served model's tokenizer."""
    tokenizer = model_tokenizer(parts.model_dir)
    if tokenizer is None:
        return None
    archived = read_archive(archive_path(parts.run.config.data_dir), run_id=parts.run.run_id).records
    return drift_of(archived, tokenizer)
