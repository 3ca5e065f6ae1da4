"""Crash-only ``tokentrail run``: SIGKILL it at any moment, start it again, and it just works.

Three runs on one data directory are SIGKILLed (while the vLLM engine starts, while the
driver plays, while the run waits for its outcomes); after each, nothing the run started
(its stage processes included) may be left after 10 s. A fourth run on the same directory must then end ``completed``
with lag 0 without waiting for ``--max-open``, having sealed what the killed runs left
open; every rollout the killed runs admitted gets exactly one outcome, and those they
left open are rejected ``interrupted``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.lag import LagReader
from pipeline.kafka.reader import assigned_reader
from pipeline.process.guard import owned
from pipeline.run.journal import INTERRUPTED
from topics.codec import DecodeError, decode
from topics.records import CaptureAdmission, FinalizedEvent, Record, RolloutSeal

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

REPO = Path(__file__).resolve().parents[2]
KILLED = ["--rollouts", "8", "--group-size", "2", "--turns", "3", "--concurrency", "2", "--max-tokens", "24"]
FINAL = ["--rollouts", "2", "--group-size", "2", "--turns", "2", "--max-tokens", "16", "--stages", "inline"]
"""The run that finishes what the killed ones left: its stages in process (the killed runs
had theirs as processes), which also checks that either hosting continues the same log."""
GONE_WITHIN_S = 10.0


def start_run(data_dir: Path, log: IO[str], options: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", "--json", *options, "--data-dir", str(data_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,  # a user's kill -9 of the run, not of the test's process group
    )


def wait_for_phase(log_path: Path, phase: str, run: subprocess.Popen[str], timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(_says(line, phase) for line in log_path.read_text().splitlines()):
            return
        assert run.poll() is None, (
            f"run exited {run.returncode} before {phase!r}:\n{log_path.read_text()[-3000:]}"
        )
        time.sleep(0.1)
    raise AssertionError(f"no {phase!r} within {timeout_s}s:\n{log_path.read_text()[-3000:]}")


def _says(line: str, phase: str) -> bool:
    try:
        entry = json.loads(line)
    except ValueError:
        return False  # not one of the run's JSON log lines
    return isinstance(entry, dict) and str(entry.get("msg", "")).endswith(f": {phase}")


def kill_and_check_nothing_is_left(run: subprocess.Popen[str], data_dir: Path) -> set[str]:
    """SIGKILL the run; returns the stages it ran as processes (all gone, with the rest)."""
    marker = json.loads((data_dir / "processes-run.json").read_text())["marker"]
    started = psutil.Process(run.pid).children(recursive=True)
    stages = {name for name in ("ledger", "finalizer") if any(is_stage(p, name) for p in started)}
    run.send_signal(signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] + owned(marker)
        if not left:
            return stages
        time.sleep(0.2)
    names = sorted({f"{p.pid}:{p.name()}" for p in left if p.is_running()})
    raise AssertionError(f"{len(names)} process(es) outlived the killed run by {GONE_WITHIN_S}s: {names}")


def is_stage(process: psutil.Process, name: str) -> bool:
    """Whether ``process`` is a ``tokentrail stage NAME`` child (False once it is gone)."""
    try:
        argv = process.cmdline()
    except psutil.Error:
        return False
    return "stage" in argv and argv[argv.index("stage") + 1 : argv.index("stage") + 2] == [name]


def journal_of(data_dir: Path) -> dict[str, dict[str, Any]]:
    """Each killed run's journal: what it started and what it sealed."""
    runs: dict[str, dict[str, Any]] = {}
    for path in (data_dir / "runs").glob("*.jsonl"):
        started, sealed = set(), set()
        for line in path.read_text().splitlines()[1:]:
            entry = json.loads(line)
            started.update([entry["started"]] if "started" in entry else [])
            sealed.update([entry["sealed"]] if "sealed" in entry else [])
        runs[path.stem] = {"started": started, "open": started - sealed}
    return runs


async def read_topic(config: KafkaConfig, topic: str) -> list[Record]:
    async with LagReader(config) as reader:
        partitions = await reader.partitions([topic])
        ends = {tp: marks.highwater for tp, marks in (await reader.watermarks(partitions)).items()}
    records: list[Record] = []
    async with assigned_reader(config, dict.fromkeys(partitions)) as consumer:
        pending = {tp for tp, end in ends.items() if end > 0}
        while pending:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for record in batch:
                    try:
                        records.append(decode(record.key, record.value, record.headers).payload)
                    except DecodeError:
                        continue
            pending = {tp for tp in pending if await consumer.position(tp) < ends[tp]}
    return records


@pytest.mark.timeout(900)  # above the phases' own bounds, so a stuck run fails with its log
def test_killed_runs_leave_nothing_and_the_next_run_finishes_them(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    kills = ("starting the vLLM engine", "driving rollouts", "waiting for finalized events")
    killed: dict[str, dict[str, Any]] = {}  # each journal as its run left it (the next run closes it)
    for number, phase in enumerate(kills):
        log_path = tmp_path / f"killed-{number}.log"
        with log_path.open("w") as log:
            run = start_run(data_dir, log, KILLED)
            try:
                wait_for_phase(log_path, phase, run)
                if phase == "driving rollouts":
                    time.sleep(1.5)  # calls in flight
                stages = kill_and_check_nothing_is_left(run, data_dir)
                if phase != "starting the vLLM engine":  # the stages were running, as processes
                    assert stages == {"ledger", "finalizer"}, stages
            finally:
                if run.poll() is None:
                    run.kill()
        killed.update(journal_of(data_dir))
    left_open = {rollout for run in killed.values() for rollout in run["open"]}
    assert left_open, f"the kills left no rollout open, nothing to check: {killed}"
    for_final = {rollout for run in journal_of(data_dir).values() for rollout in run["open"]}

    log_path = tmp_path / "final.log"
    with log_path.open("w") as log:
        final = start_run(data_dir, log, FINAL)
        try:
            out, _ = final.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            final.kill()
            raise AssertionError(
                f"the final run did not end in 300 s:\n{log_path.read_text()[-4000:]}"
            ) from None
    assert final.returncode == 0, f"exit {final.returncode}:\n{log_path.read_text()[-4000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["lag"] == 0, summary
    assert summary["closed_interrupted"] == len(for_final)
    assert summary["elapsed_s"] < 300  # not held back until --max-open (600 s)
    assert not list((data_dir / "runs").glob("*.jsonl"))  # every journal is finished

    with EmbeddedBroker(storage="durable", data_dir=data_dir) as broker:
        config = broker.kafka_config()
        admission_topic = asyncio.run(read_topic(config, config.names.admission))
        admitted = {r.rollout_id for r in admission_topic if isinstance(r, CaptureAdmission)}
        # A killed run's own seal can reach the log without reaching its journal (the kill
        # fell between the broker's acknowledgement and the journal's line): that rollout
        # was closing already, and the next run's `interrupted` seal is a duplicate.
        sealed_by_its_run = {
            r.rollout_id
            for r in admission_topic
            if isinstance(r, RolloutSeal) and r.failure_reason != INTERRUPTED
        }
        outcomes: dict[str, list[FinalizedEvent]] = defaultdict(list)
        for record in asyncio.run(read_topic(config, config.names.finalized)):
            if isinstance(record, FinalizedEvent):
                outcomes[record.rollout_id].append(record)
    killed_rollouts = {rollout for run in killed.values() for rollout in run["started"]}
    assert admitted & killed_rollouts, "no killed run admitted anything"
    for rollout in (admitted & killed_rollouts) | left_open:
        assert len({(e.status, e.rejection_reason) for e in outcomes[rollout]}) == 1, (
            rollout,
            outcomes[rollout],
        )
    for rollout in left_open - sealed_by_its_run:
        (event, *_) = outcomes[rollout]
        assert (event.status, event.rejection_reason) == ("rejected", "interrupted"), event
