"""Where tansu, the embedded broker, departs from Kafka, and what the client code does
about each: the profile ``tokentrail run``, ``tokentrail broker`` and the test broker
hand to every client of theirs (``EmbeddedBroker.kafka_config``), and a process
attaching to one with ``--bootstrap`` recognises by its cluster id (``pipeline.kafka.kind``).
"""

from __future__ import annotations

from pipeline.kafka.profile import BrokerProfile

EMBEDDED_CLUSTER_PREFIX = "tokentrail-"
"""Every cluster id the embedded broker takes starts so: how a process attached with
``--broker-kind auto`` (the default) tells it from Kafka, whose ids are base64 UUIDs."""

TANSU = BrokerProfile(
    kind="tansu",
    # aiokafka sends InitProducerId v0, which tansu refuses, so an idempotent or
    # transactional producer cannot start: delivery is at-least-once, and every consumer
    # is idempotent on event ids instead.
    idempotent_producer=False,
    # A static member that restarted sent the group through repeated rebalances
    # ("member_id was not recognized") for tens of seconds before it settled: members
    # join dynamically, and a restart costs a session timeout and a join.
    static_membership=False,
    # The durable engine writes each batch as its own object at the offset it read from
    # the watermark; two producers writing one partition at once can pick the same one,
    # and the loser's batch is refused whole with the unknown-server error: sent again.
    unknown_error_is_write_conflict=True,
    # ListOffsets(latest) answers the base offset of the last batch plus one (memory
    # engine) or a stale value (durable engine) once producers batch: too small a lag.
    exact_list_offsets=False,
    # A fetch below the log start (records the store deleted by retention) is answered
    # with the records after it, never OffsetOutOfRange; offsets are otherwise gapless
    # (the unwritten ones are given back), so a fetch that starts later is a lost range.
    fetch_out_of_range=False,
    # tansu answers a fetch only once its wait is over, even when records arrived, so
    # the wait is added to every hop of an event through the stages; 25 ms keeps that
    # small at about 5% of a core per idle consumer.
    fetch_wait_ms=25,
)
