"""The event log on Kafka: configuration, an embedded tansu broker, a producer that
implements ``EventSink``, a consumer-group loop that drives a ``StageHandler``, and
exact consumer lag.

Delivery is at-least-once: outputs are acknowledged before offsets are committed and
every consumer is idempotent on event ids, because tansu (the embedded broker) cannot
run idempotent or transactional producers.
"""

from pipeline.kafka.broker import BrokerError, EmbeddedBroker, PortBusyError, StorageMode, tansu_binary
from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop, LoopStats, dead_letter
from pipeline.kafka.lag import LagError, LagReader, PartitionLag, Watermarks, total_lag
from pipeline.kafka.log import KafkaEventSink, TopicLayoutError, ensure_topics

__all__ = [
    "BrokerError",
    "CollectingHandler",
    "ConfigError",
    "ConsumerLoop",
    "EmbeddedBroker",
    "KafkaConfig",
    "KafkaEventSink",
    "LagError",
    "LagReader",
    "LoopStats",
    "PartitionLag",
    "PortBusyError",
    "StorageMode",
    "TopicLayoutError",
    "Watermarks",
    "dead_letter",
    "ensure_topics",
    "tansu_binary",
    "total_lag",
]
