"""Publishing events to Kafka.

``KafkaEventSink`` is the ``EventSink`` port on aiokafka: a record becomes an envelope,
is encoded by the contract's codec, routed by event type and keyed by rollout id, and
``publish`` returns only once the broker acknowledged every record (``acks="all"``).
The producer is idempotent where the broker serves it
(``BrokerProfile.idempotent_producer``: Kafka does, the embedded broker does not);
delivery is at-least-once either way, with idempotent consumers (DESIGN §7).

Size: an event over the codec's limit fails with ``EventTooLarge`` naming it (also when
a broker with a smaller ``message.max.bytes`` refuses it), while a dead letter is
trimmed to fit, since it is the last place bad input can go.

Retries: aiokafka retries a request within its delivery timeout; a record that still
failed with an error Kafka calls retriable (a leader moving, say) is sent again here,
a few times. An unreachable broker is not retried here: the stage waits that out
(``pipeline.kafka.errors``). On the embedded broker an unknown-server error is a write
conflict, also sent again (``BrokerProfile.unknown_error_is_write_conflict``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from types import TracebackType
from typing import Any, NoReturn, Self

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, UnknownError

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.errors import BROKER_UNREACHABLE
from pipeline.kafka.kind import broker_of
from pipeline.kafka.profile import BrokerProfile
from topics.codec import MAX_EVENT_BYTES, EventTooLarge, encode, fit_dead_letter, record_size
from topics.events import Envelope, envelope
from topics.names import TopicNames, topic_for
from topics.records import DeadLetter, Record

REQUEST_OVERHEAD_BYTES = 64 * 1024
"""Room for batch and record framing above the codec's event limit."""
SEND_RETRIES = 8
SEND_BACKOFF_S = 0.005

_Encoded = tuple[Envelope[Record], bytes, bytes, list[tuple[str, bytes]]]


class KafkaEventSink:
    """The ``EventSink`` port on an aiokafka producer.

    Every ``publish`` awaits its own acknowledgements, so a stage can commit its input
    offsets right after ``publish`` returns. Records are sent at once (``linger_ms`` 0):
    every caller waits for its acknowledgement, so a linger is pure latency, and records
    published while a request is in flight still go out together in the next one
    (measured in bench/RESULTS.md, "Main job").
    """

    def __init__(
        self,
        config: KafkaConfig,
        *,
        linger_ms: int = 0,
        max_batch_size: int = 256 * 1024,
        max_request_size: int = MAX_EVENT_BYTES + REQUEST_OVERHEAD_BYTES,
        compression_type: str | None = None,
    ) -> None:
        self.config = config
        self.names: TopicNames = config.names
        self._settings: dict[str, Any] = {
            "acks": "all",
            "linger_ms": linger_ms,
            "max_batch_size": max_batch_size,
            "max_request_size": max_request_size,
            "compression_type": compression_type,
        }
        self._producer: AIOKafkaProducer | None = None
        self._broker: BrokerProfile | None = None
        self.published = 0

    async def start(self) -> None:
        if self._producer is not None:
            return
        broker = await broker_of(self.config)
        producer = AIOKafkaProducer(
            **self.config.client_kwargs(), **self._settings, enable_idempotence=broker.idempotent_producer
        )
        await producer.start()
        self._producer, self._broker = producer, broker

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def publish(self, records: Sequence[Record]) -> None:
        """Send every record, then wait until the broker acknowledged all of them.

        On failure the first error is raised after all sends settled; some records may
        have been written, which is harmless because event ids are deterministic. An
        event too large to write raises ``EventTooLarge`` before anything is sent.
        Records refused with a retriable error are sent again, in their order.
        """
        if not records:
            return
        pending: list[_Encoded] = []
        for record in records:
            event = envelope(fit_dead_letter(record) if isinstance(record, DeadLetter) else record)
            pending.append((event, *encode(event)))
        for attempt in range(SEND_RETRIES + 1):
            results = await self._send_all(pending)
            failed = [(item, r) for item, r in zip(pending, results, strict=True) if r is not None]
            if not failed:
                break
            if attempt == SEND_RETRIES or not all(_send_again(self._require_broker(), r) for _, r in failed):
                _raise_first(failed)
            pending = [item for item, _ in failed]
            await asyncio.sleep(random.uniform(0.0, SEND_BACKOFF_S * 2**attempt))  # desynchronize
        self.published += len(records)

    async def _send_all(self, encoded: Sequence[_Encoded]) -> list[BaseException | None]:
        """Send in order and wait for every acknowledgement; each record's error or None."""
        producer = self._require_producer()
        pending: list[asyncio.Future[Any]] = []
        for event, key, value, headers in encoded:
            topic = topic_for(self.names, event.event_type.value)
            try:
                pending.append(await producer.send(topic, value=value, key=key, headers=headers))
            except MessageSizeTooLargeError as exc:  # a producer configured below the event limit
                await asyncio.gather(*pending, return_exceptions=True)  # let the sent ones settle
                limit = self._settings["max_request_size"]
                raise _too_large(event, key, value, headers, limit, "producer max_request_size") from exc
        results = await asyncio.gather(*pending, return_exceptions=True)
        return [result if isinstance(result, BaseException) else None for result in results]

    def _require_broker(self) -> BrokerProfile:
        if self._broker is None:
            raise RuntimeError("KafkaEventSink is not started; use 'async with' or await start()")
        return self._broker

    def _require_producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise RuntimeError("KafkaEventSink is not started; use 'async with' or await start()")
        return self._producer


def _send_again(broker: BrokerProfile, error: BaseException) -> bool:
    """Whether a record refused with ``error`` is sent again: an error Kafka calls
    retriable, unless the broker is unreachable, or the embedded broker's write conflict."""
    if isinstance(error, UnknownError):
        return broker.unknown_error_is_write_conflict
    return isinstance(error, KafkaError) and error.retriable and not isinstance(error, BROKER_UNREACHABLE)


def _raise_first(failed: Sequence[tuple[_Encoded, BaseException]]) -> NoReturn:
    (event, key, value, headers), error = failed[0]
    if isinstance(error, MessageSizeTooLargeError):  # a broker whose limit is lower
        raise _too_large(event, key, value, headers, None, "broker (message.max.bytes)") from error
    raise error


def _too_large(
    event: Envelope[Record],
    key: bytes,
    value: bytes,
    headers: Sequence[tuple[str, bytes]],
    limit: int | None,
    what: str,
) -> EventTooLarge:
    size = record_size(key, value, headers)
    return EventTooLarge(event.event_id, event.event_type.value, size, limit, what)
