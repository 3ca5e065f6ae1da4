"""Creating tokentrail's topics, and checking that their layout matches the deployment's."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from pipeline.kafka.config import KafkaConfig
from topics.names import TopicNames

_TOPIC_ALREADY_EXISTS = TopicAlreadyExistsError.errno
APPEND_TIME = {"message.timestamp.type": "LogAppendTime"}
"""Brokers that honour it stamp records when appended, which makes the log-time merge
exact (DESIGN §7.2); others (the embedded tansu) keep producer time."""


class TopicLayoutError(RuntimeError):
    """A topic exists with a partition count other than the deployment's."""


async def ensure_topics(config: KafkaConfig, names: TopicNames | None = None) -> list[str]:
    """Create every tokentrail topic with one partition count; return those created.

    Topics that already exist are fine, provided their partition count matches:
    a mismatch would send one rollout's events to different partitions on different
    topics, so it is an error rather than a warning.
    """
    names = names or config.names
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    await admin.start()
    try:
        wanted = [
            NewTopic(name, names.partitions, config.replication_factor, topic_configs=APPEND_TIME)
            for name in names.all()
        ]
        response = await admin.create_topics(wanted)
        created: list[str] = []
        for entry in response.topic_errors:
            topic, code = entry[0], entry[1]
            if code == 0:
                created.append(topic)
            elif code != _TOPIC_ALREADY_EXISTS:
                message = entry[2] if len(entry) > 2 else None
                raise KafkaError(f"cannot create topic {topic}: error {code} {message or ''}".strip())
        await _check_layout(admin, names)
        return created
    finally:
        await admin.close()


async def _check_layout(admin: AIOKafkaAdminClient, names: TopicNames, settle_s: float = 10.0) -> None:
    """Every topic exists with ``names.partitions`` partitions (waiting for metadata to settle)."""
    deadline = asyncio.get_running_loop().time() + settle_s
    while True:
        described = await admin.describe_topics(list(names.all()))
        errors = {entry["topic"]: entry["error_code"] for entry in described if entry["error_code"] != 0}
        if not errors:
            break
        if asyncio.get_running_loop().time() > deadline:
            raise KafkaError(f"topics not available after creation: {errors}")
        await asyncio.sleep(0.1)
    for entry in described:
        count = len(entry["partitions"])
        if count != names.partitions:
            raise TopicLayoutError(
                f"topic {entry['topic']} has {count} partitions, expected {names.partitions}"
            )
