"""One rebuild from checkpoints: the newest usable one, the log's tail, and a new cut.

The rebuilt ledger is extended in place, round after round: every row in it is final
(the rebuild's time stops at the cut, so it closes nothing a later event could change,
and what an event settles is settled), so a rebuild that continues from a checkpoint
writes again only rows that are there already, byte for byte, and adds the tail's. A
restart costs the tail, not the history. The store and its checkpoints are one pair: a
store the checkpoints were not cut from (another id, or fewer rows than a cut held: a
store lost or replaced) is rebuilt from the log's start, and said so.

The new checkpoint is cut ``margin_s`` of log time before the rebuild began: an event
appended after the rebuild read the log's ends is stamped after that (the log-time
merge's own assumption, DESIGN §7.2), so none can belong before the cut, and checkpoint
plus tail is the same sequence as the whole log. Rollouts sealed within the margin or
their grace stay open until a later rebuild passes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.replay.checkpoint import Cut, Found, Identity, newest, write
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


def identity_of(config: KafkaConfig, ledger: LedgerConfig, cluster: str, store: LedgerStore) -> Identity:
    settings = (
        f"seal_grace_s={float(ledger.seal_grace_s)} max_open_s={float(ledger.max_open_s)} "
        f"remember={DEFAULT_REMEMBER}"
    )
    return Identity(
        config.names.prefix, cluster, EVENT_SCHEMA_VERSION, config.names.partitions, settings, store.store_id
    )


async def cluster_of(config: KafkaConfig) -> str:
    async with LagReader(config) as reader:
        return await reader.cluster_id()


async def rebuild_continued(
    config: KafkaConfig,
    out: Path,
    directory: Path,
    *,
    ledger: LedgerConfig,
    margin_s: float = DEFAULT_MARGIN_S,
    progress: Progress | None = None,
) -> Continued:
    """Extend the ledger at ``out`` from the newest usable checkpoint in ``directory`` (or
    rebuild it from the log's start) and cut a new checkpoint there."""
    began = time.time()
    cluster = await cluster_of(config)
    with _resumable(out, directory, lambda store: identity_of(config, ledger, cluster, store)) as (
        store,
        identity,
        found,
    ):
        resume = found.loaded.cut if found.loaded else None
        written: list[Path] = []

        def cut(state: Cut) -> None:
            written.append(write(directory, identity, state))

        result = await rebuild(
            config,
            store,
            ledger=ledger,
            progress=progress,
            resume=resume,
            cut_at=began - margin_s,
            on_cut=cut,
        )
    return Continued(
        result,
        found.loaded.path.name if found.loaded else None,
        resume.events_covered if resume else 0,
        written[0].name if written else None,
        found.skipped,
    )


@contextmanager
def _resumable(
    out: Path, directory: Path, identify: Callable[[LedgerStore], Identity]
) -> Iterator[tuple[LedgerStore, Identity, Found]]:
    """The store at ``out`` with the newest checkpoint cut from it; a store holding rows of
    no usable checkpoint is started afresh (its rows' cut is unknown)."""
    with LedgerStore(out) as store:
        identity = identify(store)
        found = newest(directory, identity, store.rows())
        if found.loaded is not None or not store.rows():
            yield store, identity, found
            return
    out.unlink()
    found.skipped.append(
        f"ledger {out.name}: holds rows no usable checkpoint was cut from: rebuilt from the log's start"
    )
    with LedgerStore(out) as store:
        yield store, identify(store), found


__all__ = ["DEFAULT_MARGIN_S", "Continued", "cluster_of", "identity_of", "rebuild_continued"]
