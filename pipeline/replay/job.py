"""One ``tokentrail replay``: rebuild the ledger into a SQLite file (from the log's start,
from given offsets, or from the newest checkpoint), optionally compare it with the live
ledger, and, with ``every_s``, do it again and again to keep a checkpoint current."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from pipeline.kafka.config import KafkaConfig
from pipeline.replay.continued import rebuild_continued
from pipeline.replay.parallel import rebuild_parallel
from pipeline.replay.rebuild import compare, materialize
from pipeline.replay.settings import ReplaySettings
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig


def replays(config: KafkaConfig, job: ReplaySettings) -> Iterator[dict[str, Any]]:
    """Each rebuild's report: one, or with ``every_s`` one after another, that long apart,
    for as long as the caller keeps asking."""
    while True:
        yield asyncio.run(replay_once(config, job))
        if job.every_s is None:
            return
        time.sleep(job.every_s)


async def replay_once(config: KafkaConfig, job: ReplaySettings) -> dict[str, Any]:
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
