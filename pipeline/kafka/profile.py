"""What the Kafka client code may ask of the broker it talks to.

The producer, the consumer loop and the lag reader read one ``BrokerProfile`` from
their ``KafkaConfig`` (``KafkaConfig.broker``). ``KAFKA``, the default, is Apache
Kafka's contract: an idempotent producer, static group membership for a process with a
stable instance id, offsets from ListOffsets, retries only for errors Kafka calls
retriable. A broker that departs from it gets a profile of its own that says where and
why, next to the code that runs it (the embedded broker: ``pipeline.kafka.embedded.tansu``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BrokerProfile:
    """The Kafka guarantees and answers one kind of broker gives."""

    kind: str
    """The name ``--broker-kind`` takes for it."""
    idempotent_producer: bool
    """Producers run with ``enable_idempotence`` (InitProducerId; no duplicates or
    reordering from the producer's own retries)."""
    static_membership: bool
    """A consumer with a stable instance id joins with ``group.instance.id``, so a restart
    within the session timeout takes its partitions back without a rebalance."""
    unknown_error_is_write_conflict: bool
    """An unknown-server error on produce means "nothing of the batch was written" and is
    sent again; on Kafka it means a broker bug and is raised."""
    exact_list_offsets: bool
    """ListOffsets(latest) is the high watermark. Where it is not, lag reads the high
    watermark a Fetch response carries instead (``LagReader.watermarks``)."""
    fetch_out_of_range: bool
    """A fetch below the log start is refused (OffsetOutOfRange), so the consumer loop
    learns of records deleted before it read them. Where it is not (the fetch answers
    the records after them), the loop takes a fetched partition that starts past where
    it asked for a lost range."""
    fetch_wait_ms: int
    """Default for how long the broker may hold a fetch with nothing new
    (``fetch.max.wait.ms``). A broker that answers as soon as records arrive makes it
    only the idle poll; one that always waits it out makes it latency on every hop."""


KAFKA = BrokerProfile(
    kind="kafka",
    idempotent_producer=True,
    static_membership=True,
    unknown_error_is_write_conflict=False,
    exact_list_offsets=True,
    fetch_out_of_range=True,
    fetch_wait_ms=500,
)
"""Apache Kafka, and any broker that keeps its contract: what a deployment attaching to
``--bootstrap`` gets unless it names another kind."""
