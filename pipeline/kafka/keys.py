"""Which partition a key lands in: the producer's own default partitioner.

Every topic has one partition count and the producers key each rollout's events by its
rollout id (``topics.names``), so a rollout's events all lie in one partition number of
every topic, and a reader after one rollout reads that number alone.
"""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner

_PARTITIONER = DefaultPartitioner()


def partition_of(key: str, partitions: int) -> int:
    """The partition ``key`` is produced to, of ``partitions``."""
    numbers = list(range(partitions))
    return int(_PARTITIONER(key.encode(), numbers, numbers))


__all__ = ["partition_of"]
