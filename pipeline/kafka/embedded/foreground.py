"""The embedded broker as a foreground process: start it, create the topics, say where it
is, and serve until SIGINT or SIGTERM or until it dies (what ``tokentrail broker`` runs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.embedded.broker import EmbeddedBroker, StorageMode
from pipeline.kafka.embedded.objectstore import Upkeep
from pipeline.kafka.retention import TopicRetention
from pipeline.process.signals import stop_event_on_signals, wait_until
from topics.names import TopicNames


@dataclass(frozen=True, slots=True)
class TopicsToCreate:
    """The tokentrail topics the broker creates once it is up, with their retention."""

    names: TopicNames
    retention: TopicRetention


@dataclass(frozen=True, slots=True)
class ForegroundBroker:
    """What ``tokentrail broker`` serves: where, on which store, and what it creates."""

    storage: StorageMode
    data_dir: str | None
    host: str
    port: int | None
    topics: TopicsToCreate | None
    """None: create no topics."""
    as_json: bool
    upkeep: Upkeep | None = None
    """When the durable store deletes by retention and packs (None: its defaults)."""


def serve_in_foreground(settings: ForegroundBroker) -> None:
    """Serve until SIGINT or SIGTERM. Raises ``BrokerError`` when the broker does not start
    (``StoreLockedError``: another live broker holds the store) or dies while serving, and
    ``ConfigError``, ``KafkaError`` or ``OSError`` when its topics cannot be created."""
    with stop_event_on_signals() as stop:
        broker = EmbeddedBroker(
            storage=settings.storage,
            data_dir=settings.data_dir,
            host=settings.host,
            port=settings.port,
            upkeep=settings.upkeep,
        )
        broker.start()
        try:
            broker.on_failure(lambda failure: stop.set())
            created: list[str] = []
            if settings.topics is not None:
                config = dataclasses.replace(
                    broker.kafka_config(settings.topics.names), retention=settings.topics.retention
                )
                created = asyncio.run(ensure_topics(config))
            announce(broker, settings, created)
            wait_until(stop)
        finally:
            broker.stop()
    if broker.failure is not None:
        raise broker.failure


def announce(broker: EmbeddedBroker, settings: ForegroundBroker, created: list[str]) -> None:
    """The one line on stdout that says the broker answers, and where."""
    if settings.as_json:
        document = {
            "bootstrap": broker.bootstrap,
            "storage": settings.storage,
            "data_dir": str(broker.data_dir) if broker.data_dir else None,
            "cluster_id": broker.cluster_id,
            "created_topics": created,
        }
        print(json.dumps(document, sort_keys=True), flush=True)
    else:
        print(f"tansu broker ({settings.storage}) ready at {broker.bootstrap}", flush=True)
