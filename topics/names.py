"""Topic names and the partition count every tokentrail topic shares.

All topics use one partition count and Kafka's default key partitioner on
``rollout_id``, so one stage instance sees every event of a rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "tokentrail"
DEFAULT_PARTITIONS = 4


@dataclass(frozen=True, slots=True)
class TopicNames:
    """The five topics of one deployment; ``prefix`` lets several share a cluster."""

    prefix: str = DEFAULT_PREFIX
    partitions: int = DEFAULT_PARTITIONS

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError(f"partitions: must be >= 1, got {self.partitions}")
        if not self.prefix or any(c not in _TOPIC_CHARS for c in self.prefix):
            raise ValueError(f"prefix: {self.prefix!r} is not a valid Kafka topic prefix")

    @property
    def admission(self) -> str:
        return f"{self.prefix}.admission"

    @property
    def staged(self) -> str:
        return f"{self.prefix}.staged"

    @property
    def committed(self) -> str:
        return f"{self.prefix}.committed"

    @property
    def finalized(self) -> str:
        return f"{self.prefix}.finalized"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    def all(self) -> tuple[str, ...]:
        return (self.admission, self.staged, self.committed, self.finalized, self.deadletter)


_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def topic_for(names: TopicNames, event_type: str) -> str:
    """The topic an event type is published to."""
    routes = {
        "admission": names.admission,
        "seal": names.admission,
        "staged": names.staged,
        "call_committed": names.committed,
        "call_failed": names.committed,
        "receipt": names.committed,
        "finalized": names.finalized,
        "deadletter": names.deadletter,
    }
    try:
        return routes[event_type]
    except KeyError:
        raise ValueError(f"event_type: no topic for {event_type!r}") from None
