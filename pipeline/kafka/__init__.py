"""The event log on Kafka: configuration, an embedded tansu broker, a producer that
implements ``EventSink``, a consumer-group loop that drives a ``StageHandler``, and
exact consumer lag.

Delivery is at-least-once: outputs are acknowledged before offsets are committed and
every consumer is idempotent on event ids, because tansu (the embedded broker) cannot
run idempotent or transactional producers.
"""

from pipeline.kafka.admin import TopicLayoutError, ensure_topics
from pipeline.kafka.broker import BrokerError, EmbeddedBroker, PortBusyError, StorageMode, tansu_binary
from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop, ConsumerTuning, LoopStats
from pipeline.kafka.lag import LagError, LagReader, PartitionLag, Watermarks, total_lag
from pipeline.kafka.producer import KafkaEventSink

__all__ = [
    "BrokerError",
    "CollectingHandler",
    "ConfigError",
    "ConsumerLoop",
    "ConsumerTuning",
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
    "ensure_topics",
    "tansu_binary",
    "total_lag",
]
