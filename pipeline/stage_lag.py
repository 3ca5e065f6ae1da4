"""Consumer lag of the two stages, each on its own input topics.

``LagReader.lag(groups, topics)`` with explicit topics reports every group on every
topic, so the ledger would show lag on ``committed`` (which it never reads). Here each
stage's group is asked about its own inputs only. One probe serializes its readings
(the live display and the final wait share it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Self

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.stage_runner import FINALIZER_GROUP, LEDGER_GROUP, finalizer_topics, ledger_topics
from topics.names import TopicNames

StageInputs = dict[str, tuple[str, Callable[[TopicNames], list[str]]]]
STAGES: StageInputs = {
    "ledger": (LEDGER_GROUP, ledger_topics),
    "finalizer": (FINALIZER_GROUP, finalizer_topics),
}


class StageLagProbe:
    """Lag per stage (group total over its input partitions)."""

    def __init__(self, config: KafkaConfig, stages: StageInputs = STAGES) -> None:
        self.config = config
        self.stages = stages
        self._reader = LagReader(config)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> Self:
        await self._reader.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._reader.stop()

    async def read(self) -> dict[str, int]:
        async with self._lock:
            result: dict[str, int] = {}
            for stage, (group, topics) in self.stages.items():
                rows = await self._reader.group_lag(group, topics(self.config.names))
                result[stage] = total_lag(rows)
            return result

    async def wait_for_zero(self, timeout_s: float, *, poll_s: float = 0.25) -> dict[str, int]:
        """Poll until every stage's lag is 0 or ``timeout_s`` passed; returns the last reading."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            reading = await self.read()
            if not any(reading.values()) or asyncio.get_running_loop().time() >= deadline:
                return reading
            await asyncio.sleep(poll_s)
