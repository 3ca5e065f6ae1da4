"""Stage members as ``tokentrail stage`` child processes, for the pipeline benchmark.

Each member is the production command (``pipeline.stagehost.processes``, as
``tokentrail run --stages processes`` starts it), attached to the benchmark's data plane
through an address file, so the ledger and the finalizer each have an interpreter of
their own. What the in-process probes do there is done from outside:

- the gate: once every member is ready (its group assigned it) and the groups stayed
  quiet for a while, the members are stopped with SIGSTOP while the backlog is
  published and continued with SIGCONT when the clock starts (the pause is far shorter
  than the group session, so nobody is expelled; the report gives it as ``held_s``);
- the finalized events: followed on ``tokentrail.finalized``, each timed by its record's
  timestamp (when the finalizer's producer sent it).

Revocations and the stages' duplicate counters are not visible from outside (None).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from bench.common import process_cpu_s
from bench.stage_probes import Finalized
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerTuning
from pipeline.kafka.lag import LagReader
from pipeline.kafka.reader import assigned_reader
from pipeline.stagehost.processes import StageOptions, StageProcess, stage_command, stage_processes
from stages.ledger.stage import LedgerConfig
from stages.specs import FINALIZER, LEDGER
from topics.codec import DecodeError, decode
from topics.records import FinalizedEvent

STOP_TIMEOUT_S = 30.0


class ProcessMembers:
    """The running member processes of one configuration."""

    def __init__(self, children: dict[str, StageProcess], quiet_s: float) -> None:
        self.children = children
        self.quiet_s = quiet_s

    async def settled(self) -> None:
        """Every member is ready already (``stage_processes`` waited); then a quiet spell
        for the last join's rebalance to pass, as the in-process members get."""
        await asyncio.sleep(self.quiet_s)

    def hold(self) -> None:
        self._signal(signal.SIGSTOP)

    def release(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        for child in self.children.values():
            os.kill(child.pid, signum)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of each member process."""
        return {name: process_cpu_s(child.pid) or 0.0 for name, child in self.children.items()}

    def duplicates(self) -> dict[str, int | None]:
        return {"ledger": None, "finalizer": None}

    def revocations(self) -> int | None:
        return None


def attached_plane(addresses: Any, scratch: Path) -> dict[str, Any]:
    """Stage settings that attach to a running data plane (its addresses written under
    ``scratch``) and spool retained samples there too."""
    return {
        "dataplane_mode": "attach",
        "dataplane_addresses": addresses.write(scratch / "dataplane.json"),
        "retain_dir": scratch / "retained-samples",
    }


@contextlib.asynccontextmanager
async def process_members(
    kafka: KafkaConfig,
    count: int,
    addresses: Any,
    finalized: dict[str, Finalized],
    tag: str,
    *,
    tuning: ConsumerTuning,
    quiet_s: float,
) -> AsyncIterator[ProcessMembers]:
    """``count`` ledger and ``count`` finalizer processes in groups of their own (``tag``),
    ready; the finalized topic followed into ``finalized``; all stopped on exit."""
    failures: list[str] = []
    stop = asyncio.Event()

    def failed(reason: str) -> None:
        failures.append(reason)
        stop.set()

    with tempfile.TemporaryDirectory(prefix="bench-stages-") as scratch:
        plane = attached_plane(addresses, Path(scratch))
        commands = {
            f"{spec.name}-{index}": stage_command(
                spec.name,
                kafka,
                StageOptions(LedgerConfig(), tuning, data_plane=plane, group=f"{spec.group}-{tag}"),
            )
            for index in range(count)
            for spec in (LEDGER, FINALIZER)
        }
        log_path = Path(scratch) / "stages.log"
        with log_path.open("w") as log:
            async with (
                _following(kafka, finalized),
                stage_processes(
                    commands, on_failure=failed, stop=stop, stop_timeout_s=STOP_TIMEOUT_S, stderr=log
                ) as started,
            ):
                await started.ready()
                children = started.children
                if failures:
                    raise RuntimeError(f"{failures[0]}; its log:\n{log_path.read_text()[-3000:]}")
                yield ProcessMembers(children, quiet_s)
                if failures:
                    raise RuntimeError(f"{failures[0]}; its log:\n{log_path.read_text()[-3000:]}")


@contextlib.asynccontextmanager
async def _following(kafka: KafkaConfig, finalized: dict[str, Finalized]) -> AsyncIterator[None]:
    """The first finalized event of each rollout, while the context is open."""

    def first(event: FinalizedEvent, event_id: str, sent_at: float) -> None:
        finalized.setdefault(event.rollout_id, Finalized(event, sent_at))

    async with following_finalized(kafka, first):
        yield


@contextlib.asynccontextmanager
async def following_finalized(
    kafka: KafkaConfig, on_event: Callable[[FinalizedEvent, str, float], None]
) -> AsyncIterator[None]:
    """Every finalized event on the (fresh) topic, from its start, while the context is
    open: ``on_event(event, event id, when its producer sent it)``."""
    async with LagReader(kafka) as reader:
        partitions = await reader.partitions([kafka.names.finalized])
    async with assigned_reader(kafka, dict.fromkeys(partitions), fetch_max_wait_ms=50) as consumer:

        async def follow() -> None:
            while True:
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    for record in batch:
                        try:
                            event = decode(record.key, record.value, record.headers)
                        except DecodeError:
                            continue
                        if isinstance(event.payload, FinalizedEvent):
                            on_event(event.payload, event.event_id, record.timestamp / 1e3)

        task = asyncio.create_task(follow(), name="finalized-follower")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
