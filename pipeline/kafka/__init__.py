"""The event log on Kafka: configuration, a producer that implements ``EventSink``, a
consumer-group loop that drives a ``StageHandler``, and exact consumer lag.

This is the code every deployment runs, written to Apache Kafka's contract; where a
broker departs from it, its ``BrokerProfile`` says so (``pipeline.kafka.profile``). The
embedded broker that single-machine runs and tests start lives apart, in
``pipeline.kafka.embedded``. Delivery is at-least-once: outputs are acknowledged before
offsets are committed and every consumer is idempotent on event ids.
"""

from pipeline.kafka.admin import TopicLayoutError, ensure_topics
from pipeline.kafka.config import BROKER_KINDS, ConfigError, KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop, ConsumerTuning, LoopStats
from pipeline.kafka.lag import LagError, LagReader, PartitionLag, Watermarks, total_lag
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.profile import KAFKA, BrokerProfile

__all__ = [
    "BROKER_KINDS",
    "KAFKA",
    "BrokerProfile",
    "CollectingHandler",
    "ConfigError",
    "ConsumerLoop",
    "ConsumerTuning",
    "KafkaConfig",
    "KafkaEventSink",
    "LagError",
    "LagReader",
    "LoopStats",
    "PartitionLag",
    "TopicLayoutError",
    "Watermarks",
    "ensure_topics",
    "total_lag",
]
