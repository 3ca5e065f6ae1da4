"""The event log on Kafka: configuration, an embedded tansu broker, a producer that
implements ``EventSink``, a consumer-group loop that drives a ``StageHandler``, and
exact consumer lag.

Delivery is at-least-once: outputs are acknowledged before offsets are committed and
every consumer is idempotent on event ids, because tansu (the embedded broker) cannot
run idempotent or transactional producers.
"""

from pipeline.kafka.broker import BrokerError, EmbeddedBroker, StorageMode, tansu_binary
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop
from pipeline.kafka.lag import LagReader, PartitionLag, total_lag
from pipeline.kafka.log import KafkaEventSink, ensure_topics

__all__ = [
    "BrokerError",
    "CollectingHandler",
    "ConsumerLoop",
    "EmbeddedBroker",
    "KafkaConfig",
    "KafkaEventSink",
    "LagReader",
    "PartitionLag",
    "StorageMode",
    "ensure_topics",
    "tansu_binary",
    "total_lag",
]
