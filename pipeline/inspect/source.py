"""The data directory of a finished run, read once into what the views show.

Two sources, each optional: the durable event log (``pipeline.inspect.log``: the ledger
rebuilt from it, seals, finalized events, the stages' lag) and the sample archive
(``DATA_DIR/samples.jsonl``, ``pipeline.samples.archive``). What one lacks, the views say;
with no log, the table still lists every archived (accepted) rollout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.inspect.log import LogContents, LogUnavailable, read_live_log, read_run_log
from pipeline.inspect.rollout import RolloutDetail, rollout_detail
from pipeline.inspect.table import RolloutRow, RolloutTable
from pipeline.inspect.timeline import Timeline, timeline
from pipeline.inspect.tokens import Decoder, TokenView, load_decoder, render_tokens
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import BUCKET_DIR
from pipeline.run.config import TINY_MODEL_DIR_NAME
from pipeline.samples.archive import ARCHIVE_NAME, archive_path, read_archive
from pipeline.trainer.steplog import StepLog, read_steps


class NotADataDir(ValueError):
    """The path holds nothing ``tokentrail run`` writes."""


def check_data_dir(path: Path, *, live: bool = False) -> None:
    """A run's data dir holds its archive or its log; beside a live log, any directory will do
    (the deployment's archiver may not have written yet)."""
    if not path.is_dir():
        raise NotADataDir(f"{path}: no such directory")
    if not live and not ((path / ARCHIVE_NAME).is_file() or (path / BUCKET_DIR).is_dir()):
        raise NotADataDir(
            f"{path}: not a tokentrail data directory (no {ARCHIVE_NAME} and no event log {BUCKET_DIR}/)"
        )


def archived_rows(records: Iterable[Mapping[str, Any]]) -> list[RolloutRow]:
    """Rows from the archive alone: every archived rollout was accepted."""
    by_rollout: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        by_rollout.setdefault(str(record["rollout_id"]), []).append(record)
    rows = []
    for rollout_id, samples in by_rollout.items():
        versions = [v for s in samples for v in s["weight_versions"]]
        rows.append(
            RolloutRow(
                rollout_id=rollout_id,
                run_id=str(samples[0]["run_id"]),
                group_id=samples[0].get("group_id"),
                status="accepted",
                failure_code=None,
                reward=samples[0].get("reward"),
                calls=None,
                tokens=sum(len(s["token_ids"]) for s in samples),
                min_version=min(versions, default=None),
                max_version=max(versions, default=None),
                sample_policy="-",
                sample_keys=tuple(str(s.get("sample_key") or rollout_id) for s in samples),
            )
        )
    return rows


@dataclass(frozen=True, slots=True)
class ArchiveSummary:
    samples: int
    skipped_lines: int
    runs: list[str]


class RunSource:
    """Everything the inspector shows, read from one data directory at start."""

    def __init__(self, data_dir: Path, log: LogContents | LogUnavailable, decoder: Decoder | None) -> None:
        self.data_dir = data_dir
        self.log = log
        self.decoder = decoder
        contents = read_archive(archive_path(data_dir))
        self.samples = {str(r.get("sample_key") or r["rollout_id"]): r for r in contents.records}
        self.archive = ArchiveSummary(len(contents.records), contents.skipped_lines, contents.runs)
        steps, self.unreadable_steps = read_steps(data_dir)
        self.steps = {log.name: log for log in steps}
        """The train steps the trainer recorded (``DATA_DIR/steps``), by name."""
        self.timeline: Timeline | None = None
        if isinstance(log, LogContents):
            self.table = RolloutTable.from_log(log.seals, log.finalized)
            self.timeline = timeline(log.finalized.values())
        else:
            self.table = RolloutTable(archived_rows(contents.records))

    @classmethod
    def open(
        cls, data_dir: Path, scratch: Path, model_dir: Path | None = None, kafka: KafkaConfig | None = None
    ) -> RunSource:
        """Check the path, read the log (through a copy in ``scratch``, or from ``kafka``'s
        brokers for a running deployment), load the tokenizer."""
        check_data_dir(data_dir, live=kafka is not None)
        log = read_run_log(data_dir, scratch) if kafka is None else read_live_log(kafka, scratch)
        return cls(data_dir, log, load_decoder(model_dir or data_dir / TINY_MODEL_DIR_NAME))

    @property
    def log_problem(self) -> str | None:
        return self.log.reason if isinstance(self.log, LogUnavailable) else None

    def rollout(self, rollout_id: str) -> RolloutDetail | None:
        """The call tree and outcome; None when neither the log nor the archive knows the id."""
        if self.table.get(rollout_id) is None:
            return None
        if isinstance(self.log, LogUnavailable):
            return None
        calls, receipt = self.log.ledger.rollout(rollout_id)
        return rollout_detail(rollout_id, calls, receipt, self.log.finalized.get(rollout_id))

    def tokens(self, sample_key: str, step: StepLog | None = None) -> TokenView | None:
        """The sample's tokens; beside ``step``'s trainer logprobs when that step trained on it."""
        record = self.samples.get(sample_key)
        if record is None:
            return None
        trainer = None if step is None else step.trainer_logprobs.get(sample_key)
        if step is None or trainer is None:
            return render_tokens(record, self.decoder)
        return render_tokens(record, self.decoder, step=step.name, trainer_logprobs=trainer)

    def steps_of(self, sample_key: str) -> list[str]:
        """The recorded steps that trained on the sample."""
        return [name for name, log in self.steps.items() if sample_key in log.trainer_logprobs]

    def archived_keys(self, rollout_id: str) -> list[str]:
        return [key for key, r in self.samples.items() if r["rollout_id"] == rollout_id]
