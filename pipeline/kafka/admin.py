"""Creating tokentrail's topics, and checking that their layout matches the deployment's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.retention import differences
from topics.names import TopicNames

log = logging.getLogger(__name__)

_TOPIC_ALREADY_EXISTS = TopicAlreadyExistsError.errno
APPEND_TIME = {"message.timestamp.type": "LogAppendTime"}
"""Brokers that honour it stamp records when appended, which makes the log-time merge
exact (DESIGN §7.2); others (the embedded tansu) keep producer time."""


class TopicLayoutError(RuntimeError):
    """A topic exists with a partition count other than the deployment's."""


async def ensure_topics(config: KafkaConfig, names: TopicNames | None = None) -> list[str]:
    """Create every tokentrail topic with one partition count and its retention
    (``config.retention``, DESIGN §7.6); return those created.

    Topics that already exist are fine, provided their partition count matches:
    a mismatch would send one rollout's events to different partitions on different
    topics, so it is an error rather than a warning. Their retention is compared and a
    difference logged, never altered: every stage calls this on start, and one started
    with other flags must not rewrite a cluster's settings behind its operator's back.
    """
    names = names or config.names
    retention = config.retention.topic_configs(names)
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    await admin.start()
    try:
        wanted = [
            NewTopic(
                name,
                names.partitions,
                config.replication_factor,
                topic_configs={**APPEND_TIME, **retention[name]},
            )
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
        await _report_retention(
            admin, {topic: retention[topic] for topic in names.all() if topic not in created}
        )
        return created
    finally:
        await admin.close()


async def _report_retention(admin: AIOKafkaAdminClient, asked: Mapping[str, Mapping[str, str]]) -> None:
    """Log each existing topic whose retention differs from what was asked (or cannot be read)."""
    if not asked:
        return
    try:
        answers = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic) for topic in asked]
        )
    except KafkaError as exc:
        log.warning("cannot read the retention of the existing topics %s: %r", ", ".join(asked), exc)
        return
    for answer in answers:
        for error_code, error_message, _kind, topic, entries in answer.resources:
            if error_code != 0:
                log.warning(
                    "cannot read the retention of topic %s: error %s %s", topic, error_code, error_message
                )
                continue
            changed = differences(asked[topic], {entry[0]: entry[1] for entry in entries})
            if changed:
                log.warning(
                    "topic %s exists with another retention than asked (%s); existing topics are not altered: "
                    "change it with the cluster's tools (kafka-configs.sh --alter) if that is not meant",
                    topic,
                    "; ".join(changed),
                )


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
