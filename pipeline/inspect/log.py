"""A finished run's durable event log, read without touching it.

``tokentrail run`` keeps its log in the data directory (tansu's ``s3://`` store, DESIGN
§3). The inspector copies that store into a scratch folder and starts its own embedded
broker on the copy, so the run's files are never opened for writing, a live run's lock is
never contended, and nothing it reads can reach the pipeline. A running deployment's log
is read from its brokers (``--bootstrap``) the same way. Either way the ledger is rebuilt
by the ledger stage's own logic into a local SQLite file (``pipeline.replay.rebuild``),
the seals and finalized events are read group-less, and the stages' committed offsets are
only looked at. When no log can be read, the reason is kept and shown instead.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

from aiokafka.errors import KafkaError

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import BUCKET_DIR, CLUSTER_ID_FILE, BrokerError, EmbeddedBroker
from pipeline.kafka.embedded.snapshot import copy_store
from pipeline.kafka.lag import LagReader, lag_by_group
from pipeline.replay.rebuild import read_log, rebuild
from pipeline.replay.store import LedgerStore
from stages.specs import STAGES
from topics.records import FinalizedEvent, RolloutSeal


@dataclass(frozen=True, slots=True)
class LogContents:
    """Everything the inspector takes from the log."""

    ledger: LedgerStore
    seals: dict[str, RolloutSeal]
    finalized: dict[str, FinalizedEvent]
    lag: dict[str, int]
    """Stage name → records its group had not committed when the log was copied."""
    events: int
    """Events the ledger was rebuilt from."""


@dataclass(frozen=True, slots=True)
class LogUnavailable:
    """Why the log could not be read; the views say it instead of guessing."""

    reason: str


def read_run_log(data_dir: Path, scratch: Path) -> LogContents | LogUnavailable:
    """Copy the data directory's log into ``scratch`` and read it through a broker of our own."""
    store = data_dir / BUCKET_DIR
    cluster_id = data_dir / CLUSTER_ID_FILE
    if not store.is_dir() or not cluster_id.is_file():
        return LogUnavailable(
            f"{data_dir} holds no durable event log (a run with --broker-storage memory keeps none)"
        )
    copy = scratch / "log"
    try:
        copy_store(store, copy / BUCKET_DIR)  # the run may still be writing it
        shutil.copy2(cluster_id, copy / CLUSTER_ID_FILE)
        with EmbeddedBroker(storage="durable", data_dir=copy) as broker:
            return asyncio.run(_read(broker.kafka_config(), scratch / "ledger.sqlite"))
    except (BrokerError, KafkaError, OSError) as exc:
        return LogUnavailable(f"the event log in {store} could not be read: {exc}")


LIVE_READ_TIMEOUT_S = 120.0
"""A deployment's brokers that give nothing back in this long are reported down."""


def read_live_log(
    config: KafkaConfig, scratch: Path, timeout_s: float = LIVE_READ_TIMEOUT_S
) -> LogContents | LogUnavailable:
    """Read a running deployment's log from its brokers, once, as it stands now."""
    try:
        return asyncio.run(asyncio.wait_for(_read(config, scratch / "ledger.sqlite"), timeout_s))
    except (KafkaError, OSError, TimeoutError) as exc:
        return LogUnavailable(f"the brokers at {config.bootstrap} could not be read: {exc!r}")


async def _read(config: KafkaConfig, ledger_path: Path) -> LogContents:
    ledger = LedgerStore(ledger_path)
    result = await rebuild(config, ledger)
    seals: dict[str, RolloutSeal] = {}
    finalized: dict[str, FinalizedEvent] = {}
    names = config.names
    async for batch, _, _ in read_log(config, [names.admission, names.finalized]):
        for item in batch:
            payload = item.event.payload
            if isinstance(payload, RolloutSeal):
                seals.setdefault(payload.rollout_id, payload)
            elif isinstance(payload, FinalizedEvent):
                finalized.setdefault(payload.rollout_id, payload)
    groups = {spec.group: name for name, spec in STAGES.items()}
    async with LagReader(config) as reader:
        rows = await reader.lag(groups)
    lag = {groups[group]: value for group, value in lag_by_group(rows).items()}
    return LogContents(ledger, seals, finalized, lag, result.events)
