"""Which failures mean "the broker cannot be reached right now", as opposed to bad input
or a bug: a stage waits those out and reconnects, and ``tokentrail lag`` reports them as
the broker being down rather than as lag."""

from __future__ import annotations

from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, RequestTimedOutError

BROKER_UNREACHABLE: tuple[type[BaseException], ...] = (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    ConnectionError,
    TimeoutError,
)
