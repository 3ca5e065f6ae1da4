"""The recall rule: a stage re-reads which rollouts it answered whenever it is given partitions.

A stage remembers answered rollouts in memory only, so that memory dies with the
process and does not follow a partition to another group member. On every assignment
the host seeds it from the tail of the stage's output topic, for the assigned
partitions (a rollout's events share a partition number on every topic), so input
replayed after a restart or a rebalance is not answered a second time (DESIGN §7).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.tail import recent_keys
from stages.ports import StagePort
from stages.specs import StageSpec

log = logging.getLogger(__name__)


async def recall_answered(
    stage: StagePort, spec: StageSpec, config: KafkaConfig, partitions: Iterable[int] | None = None
) -> int:
    """Seed ``stage.answered`` from its output topic's tail (only ``partitions``, if given);
    returns how many rollouts it recalled."""
    topic = spec.output(config.names)
    keys = await recent_keys(
        config, topic, spec.answer, per_partition=stage.answered.capacity, partitions=partitions
    )
    stage.answered.update(keys)
    log.info("stage %s recalled %d answered rollout(s) from %s", spec.name, len(keys), topic)
    return len(keys)
