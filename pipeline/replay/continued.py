"""One rebuild from checkpoints: the newest usable one, the log's tail, and a new cut.

The output is built in a file of its own and renamed over ``out`` once whole, so a
rebuild killed mid-way leaves the previous output (and the checkpoints) as they were:
running it again is the recovery. The new checkpoint is cut ``margin_s`` of log time
before the rebuild began: an event appended after the rebuild read the log's ends is
stamped after that (the log-time merge's own assumption, DESIGN §7.2), so none can
belong before the cut, and checkpoint plus tail is the same sequence as the whole log.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.replay.checkpoint import Cut, Identity, newest, restore_store, write
from pipeline.replay.rebuild import Progress, ReplayResult, rebuild
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from stages.recent import DEFAULT_REMEMBER
from topics.records import EVENT_SCHEMA_VERSION

DEFAULT_MARGIN_S = 60.0


@dataclass(slots=True)
class Continued:
    """What one rebuild from checkpoints did."""

    result: ReplayResult
    resumed_from: str | None
    events_before: int
    """Events the checkpoint it continued from covered (0 from the log's start)."""
    checkpoint: str | None = None
    skipped: list[str] = field(default_factory=list)


async def identity_of(config: KafkaConfig, ledger: LedgerConfig) -> Identity:
    async with LagReader(config) as reader:
        cluster = await reader.cluster_id()
    settings = (
        f"seal_grace_s={float(ledger.seal_grace_s)} max_open_s={float(ledger.max_open_s)} "
        f"remember={DEFAULT_REMEMBER}"
    )
    return Identity(config.names.prefix, cluster, EVENT_SCHEMA_VERSION, config.names.partitions, settings)


async def rebuild_continued(
    config: KafkaConfig,
    out: Path,
    directory: Path,
    *,
    ledger: LedgerConfig,
    margin_s: float = DEFAULT_MARGIN_S,
    progress: Progress | None = None,
) -> Continued:
    """Rebuild into ``out`` from the newest usable checkpoint in ``directory`` (or the
    log's start) and cut a new checkpoint there."""
    began = time.time()
    identity = await identity_of(config, ledger)
    found = newest(directory, identity)
    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    if found.loaded is not None:
        restore_store(found.loaded, partial)
    resume = found.loaded.cut if found.loaded else None
    written: list[Path] = []
    with LedgerStore(partial) as store:

        def cut(state: Cut) -> None:
            written.append(write(directory, store, identity, state))

        result = await rebuild(
            config,
            store,
            ledger=ledger,
            progress=progress,
            resume=resume,
            cut_at=began - margin_s,
            on_cut=cut,
        )
    os.replace(partial, out)
    return Continued(
        result,
        found.loaded.path.name if found.loaded else None,
        resume.events_covered if resume else 0,
        written[0].name if written else None,
        found.skipped,
    )


__all__ = ["DEFAULT_MARGIN_S", "Continued", "identity_of", "rebuild_continued"]
