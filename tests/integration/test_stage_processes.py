"""Stages as child processes (``pipeline.stagehost.processes``) on the real broker: a real
``tokentrail stage ledger`` child is waited for until its group assigned it, stops cleanly
on SIGTERM, and a child that dies, before or after it was ready, is reported once."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.stagehost.processes import StageOptions, stage_command, stage_processes
from stages.ledger.stage import LedgerConfig

pytestmark = pytest.mark.broker


def ledger_command(kafka: KafkaConfig, *extra: str) -> dict[str, list[str]]:
    options = StageOptions(ledger=LedgerConfig(seal_grace_s=1.0), tuning=FAST_GROUPS)
    return {"ledger": [*stage_command("ledger", kafka, options), *extra]}


class Failures:
    """``on_failure``: what was reported, and the stop it requests (as a run's would)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.stop = asyncio.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.stop.set()


def test_a_ready_child_stops_cleanly_and_a_killed_one_is_reported(kafka_config: KafkaConfig) -> None:
    async def go() -> tuple[list[str], int | None, list[str], int | None]:
        await ensure_topics(kafka_config)
        clean = Failures()
        async with stage_processes(
            ledger_command(kafka_config), on_failure=clean, stop=clean.stop, stop_timeout_s=30
        ) as started:
            await started.ready()
            first = started.children["ledger"]
            assert first.process is not None and first.process.returncode is None
        killed = Failures()
        async with stage_processes(
            ledger_command(kafka_config), on_failure=killed, stop=killed.stop, stop_timeout_s=30
        ) as started:
            await started.ready()
            second = started.children["ledger"]
            os.kill(second.pid, signal.SIGKILL)
            await asyncio.wait_for(killed.stop.wait(), 30)
        assert first.process is not None and second.process is not None
        return clean.reasons, first.process.returncode, killed.reasons, second.process.returncode

    clean, clean_code, killed, killed_code = asyncio.run(go())
    assert clean == [] and clean_code == 0  # SIGTERM: batch finished, committed, group left
    assert killed_code == -signal.SIGKILL
    assert len(killed) == 1 and killed[0].startswith("stage ledger stopped") and "exit code -9" in killed[0]


def test_a_child_that_exits_before_it_is_ready_is_reported(kafka_config: KafkaConfig) -> None:
    async def go() -> list[str]:
        failures = Failures()
        bad = ledger_command(kafka_config, "--remember", "many")  # argparse rejects it: exit 2
        async with stage_processes(
            bad, on_failure=failures, stop=failures.stop, stop_timeout_s=30
        ) as started:
            await started.ready()
        return failures.reasons

    reasons = asyncio.run(go())
    assert len(reasons) == 1 and "stage ledger stopped" in reasons[0] and "exit code 2" in reasons[0]
