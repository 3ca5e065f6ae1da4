"""One ``tokentrail replay``: rebuild the ledger into a SQLite file (from the log's start,
from given offsets, or from the newest checkpoint), optionally compare it with the live
ledger, and, with ``every_s``, do it again and again to keep a checkpoint current."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.replay.continued import DEFAULT_MARGIN_S, rebuild_continued
from pipeline.replay.parallel import rebuild_parallel
from pipeline.replay.rebuild import compare, materialize
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig


def parse_start_offsets(values: list[str]) -> dict[TopicPartition, int]:
    """``TOPIC:PARTITION=OFFSET`` each (``--from``): where a partition's rebuild starts."""
    offsets: dict[TopicPartition, int] = {}
    for value in values:
        try:
            where, offset = value.rsplit("=", 1)
            topic, partition = where.rsplit(":", 1)
            offsets[TopicPartition(topic, int(partition))] = int(offset)
        except ValueError:
            raise ConfigError(f"--from: {value!r} is not TOPIC:PARTITION=OFFSET") from None
    return offsets


@dataclass(frozen=True, slots=True)
class ReplayJob:
    """What to rebuild, from where, and how often. Settings that do not go together are
    a ``ConfigError`` naming the flag."""

    out: Path
    start: dict[TopicPartition, int] = field(default_factory=dict)
    seal_grace_s: float = 10.0
    processes: int = 1
    checkpoints: Path | None = None
    checkpoint_margin_s: float = DEFAULT_MARGIN_S
    every_s: float | None = None
    check: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.checkpoints is None:
            if self.every_s is not None:
                raise ConfigError("--every: keeps a checkpoint current, so it needs --checkpoints")
            return
        if self.start:
            raise ConfigError("--from: a rebuild from checkpoints starts where the newest one ends")
        if self.processes != 1:
            raise ConfigError("--processes: a rebuild from checkpoints runs in one process")


def replays(config: KafkaConfig, job: ReplayJob) -> Iterator[dict[str, Any]]:
    """Each rebuild's report: one, or with ``every_s`` one after another, that long apart,
    for as long as the caller keeps asking."""
    while True:
        yield asyncio.run(replay_once(config, job))
        if job.every_s is None:
            return
        time.sleep(job.every_s)


async def replay_once(config: KafkaConfig, job: ReplayJob) -> dict[str, Any]:
    """Rebuild once; the report names what was read and stored (and, with ``check``, every
    difference from the live ledger)."""
    ledger = LedgerConfig(seal_grace_s=job.seal_grace_s)
    report: dict[str, Any] = {"out": str(job.out)}
    with Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=not job.show_progress or not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("replay", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        if job.checkpoints is not None:
            continued = await rebuild_continued(
                config,
                job.out,
                job.checkpoints,
                ledger=ledger,
                margin_s=job.checkpoint_margin_s,
                progress=progress,
            )
            result = continued.result
            report |= {
                "resumed_from": continued.resumed_from,
                "events_before": continued.events_before,
                "checkpoint": continued.checkpoint,
                "skipped_checkpoints": continued.skipped,
            }
        else:
            with LedgerStore(job.out) as store:
                result = await rebuild_parallel(
                    config,
                    store,
                    processes=job.processes,
                    ledger=ledger,
                    start=job.start,
                    progress=progress,
                )
    report |= {
        "events": result.events,
        "undecodable": result.undecodable,
        "stored": result.stored,
        "open_rollouts": result.open_rollouts,
    }
    if job.check:
        with LedgerStore(job.out) as store, LedgerStore(job.out.with_suffix(".live.sqlite")) as live:
            await materialize(config, live)
            report["differences"] = compare(store, live)
    return report


def print_report(report: dict[str, Any], *, as_json: bool) -> None:
    """The report on stdout (one JSON document, or lines); checkpoints passed over on stderr."""
    for line in report.get("skipped_checkpoints", []):
        print(f"tokentrail replay: passed over {line}", file=sys.stderr)
    if as_json:
        print(json.dumps(report, sort_keys=True), flush=True)
        return
    if "checkpoint" in report:
        print(
            f"continued from {report['resumed_from'] or 'the log start'} "
            f"({report['events_before']} events before it); new checkpoint {report['checkpoint']}"
        )
    print(f"replayed {report['events']} events into {report['out']}: {report['stored']}", flush=True)
    for line in report.get("differences", [])[:20]:
        print(f"  {line}")
