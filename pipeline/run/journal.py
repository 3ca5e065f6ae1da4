"""What a run started and sealed, kept in the data directory so a later run can finish it.

A run killed outright (SIGKILL, a lost machine) cannot seal its in-flight rollouts, and
the ledger would hold each open until ``--max-open``, with the commit point and the lag
held back. Every run therefore keeps a journal, ``DATA_DIR/runs/RUN_ID.jsonl``: a header
naming the run's process and its event log, then one line per rollout it started (before
the first admission is published) and one per rollout whose seal the broker acknowledged.
Lines are written whole and unbuffered, so a process kill loses none.

The next run on the data directory reads the journals of runs whose process is gone: on
the same event log it seals every started, unsealed rollout as failed with the reason
``interrupted`` (the ledger rejects them at once with that code), then deletes the
journal. A run that ends on its own has sealed everything it started and deletes its
own journal.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from pipeline.process.guard import same_process
from stages.client import RolloutClient
from stages.driver import Job
from topics.failures import LedgerFailure

log = logging.getLogger(__name__)

JOURNAL_DIR = "runs"
INTERRUPTED = LedgerFailure.INTERRUPTED.value


class RunJournal:
    """This run's journal; ``close()`` deletes it when every started rollout was sealed."""

    def __init__(self, data_dir: Path, run_id: str, event_log: str) -> None:
        folder = data_dir / JOURNAL_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{run_id}.jsonl"
        self._file: IO[bytes] = self.path.open("ab", buffering=0)
        self._open: set[str] = set()
        me = psutil.Process()
        self._write({"run_id": run_id, "pid": me.pid, "started_at": me.create_time(), "log": event_log})

    def started(self, job: Job) -> None:
        self._open.add(job.rollout_id)
        self._write({"started": job.rollout_id, "group_id": job.group_id})

    def sealed(self, rollout_id: str) -> None:
        self._open.discard(rollout_id)
        self._write({"sealed": rollout_id})

    def close(self) -> None:
        self._file.close()
        if not self._open:
            self.path.unlink(missing_ok=True)

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry).encode() + b"\n")


@dataclass(frozen=True, slots=True)
class DeadRun:
    """A run whose process is gone, and the rollouts it started but never sealed."""

    run_id: str
    path: Path
    event_log: str
    unsealed: dict[str, str | None]
    """Rollout id → group id."""


def dead_runs(data_dir: Path) -> Iterator[DeadRun]:
    """The journals in ``data_dir`` whose run's process no longer exists."""
    for path in sorted((data_dir / JOURNAL_DIR).glob("*.jsonl")):
        entries = _read(path)
        if not entries or _alive(entries[0]):
            continue
        unsealed: dict[str, str | None] = {}
        for entry in entries[1:]:
            if "started" in entry:
                unsealed[str(entry["started"])] = entry.get("group_id")
            elif "sealed" in entry:
                unsealed.pop(str(entry["sealed"]), None)
        yield DeadRun(str(entries[0].get("run_id")), path, str(entries[0].get("log")), unsealed)


async def close_dead_runs(data_dir: Path, event_log: str, client: RolloutClient) -> int:
    """Seal, as failed ``interrupted``, what dead runs on this event log left open; returns
    how many rollouts were sealed. A journal of another log (a memory broker that is gone)
    is only removed: its rollouts went with that log."""
    sealed = 0
    for run in dead_runs(data_dir):
        if run.event_log == event_log:
            for rollout_id, group_id in run.unsealed.items():
                await client.seal(rollout_id, group_id=group_id, failed=INTERRUPTED)
                sealed += 1
            if run.unsealed:
                log.warning(
                    "run %s died; sealed its %d open rollout(s) as interrupted", run.run_id, len(run.unsealed)
                )
        run.path.unlink(missing_ok=True)
    return sealed


def _read(path: Path) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    with contextlib.suppress(OSError), path.open("rb") as lines:
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash while it was written
            if isinstance(entry, dict):
                entries.append(entry)
    return entries


def _alive(header: dict[str, Any]) -> bool:
    pid, started_at = header.get("pid"), header.get("started_at")
    return isinstance(pid, int) and isinstance(started_at, float) and same_process(pid, started_at)
