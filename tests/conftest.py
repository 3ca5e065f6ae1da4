"""Fixtures for tests that need real infrastructure.

One real tansu broker (memory engine, random free port) serves the whole session;
each test gets its own topic prefix and therefore its own topics and groups, so tests
never see each other's events.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pipeline.kafka.broker import EmbeddedBroker
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS, ConsumerTuning
from pipeline.process.guard import guard_descendants
from topics.names import TopicNames


def pytest_configure(config: pytest.Config) -> None:
    """Whatever the tests start dies with the test run, even if it is killed outright."""
    guard_descendants()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(storage="memory") as broker:
        yield broker


@pytest.fixture
def topic_names() -> TopicNames:
    return TopicNames(prefix=f"t{uuid.uuid4().hex[:12]}", partitions=4)


@pytest.fixture
def kafka_config(kafka_broker: EmbeddedBroker, topic_names: TopicNames) -> KafkaConfig:
    kafka_broker.check()
    return kafka_broker.kafka_config(topic_names, client_id="tokentrail-test")


@pytest.fixture
def fast_group() -> ConsumerTuning:
    """Short consumer-group timeouts: tansu holds a group join for half the session timeout."""
    return FAST_GROUPS


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
