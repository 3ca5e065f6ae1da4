"""Replay keeps log time across topics: a topic read ahead must not expire seal graces.

The ledger's clock during a rebuild is the log time of what it has read. The consumer
drains whatever partition it has buffered first, so without care a rebuild reads all
admissions and seals (one topic) before any staged event (the other), and every rollout
sealed more than a grace period before the end of the log closes as ``never_staged``
although its staged events are in the log, in time. A log of more than one fetch per
topic, spread over several grace periods, shows it.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bench.events import rollout_events
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import rebuild
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from topics.names import TopicNames

pytestmark = pytest.mark.broker

ROLLOUTS = 1500  # 3,000 admission-topic records: more than one fetch of 2,000
GRACE_S = 0.3


def test_rebuild_reads_topics_in_log_time_order(kafka_broker: EmbeddedBroker, tmp_path: Path) -> None:
    async def go() -> dict[str, int]:
        config = kafka_broker.kafka_config(TopicNames(prefix=f"t{uuid.uuid4().hex[:12]}", partitions=1))
        await ensure_topics(config)
        async with KafkaEventSink(config, linger_ms=0) as sink:
            for number in range(ROLLOUTS):  # about 2 s of log time: several grace periods
                await sink.publish(rollout_events(f"r{number}", 1))
                if number % 50 == 49:
                    await asyncio.sleep(0.06)
        with LedgerStore(tmp_path / "ledger.sqlite") as store:
            result = await rebuild(config, store, ledger=LedgerConfig(seal_grace_s=GRACE_S))
            assert result.open_rollouts == 0
            return store.counts()

    counts = asyncio.run(go())
    assert counts == {"call_committed": ROLLOUTS, "receipt": ROLLOUTS}
