"""Consumer lag of the stages: the gauge a stage process exports, and the probe a run reads.

``poll_lag`` keeps ``tokentrail_consumer_lag`` fresh: the stage's group read every few
seconds. Lag is read here, off the consumer, with its own ``LagReader`` (its own connections),
so a slow or failing reading never delays a batch. A failure is counted and logged
once per outage, the connections are rebuilt, and the last good reading stays
exported (its timestamp says how old it is) — a lag panel must not drop to zero
because the broker was briefly unreachable.

``StageLagProbe`` reads every stage's group on its own input topics only
(``LagReader.lag(groups, topics)`` with explicit topics would report every group on
every topic, so the ledger would show lag on ``committed``, which it never reads).
One probe serializes its readings (the live display and the final wait share it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.stagehost.metrics import StageMetrics
from stages.specs import STAGES, StageSpec

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


async def poll_lag(
    config: KafkaConfig,
    metrics: StageMetrics,
    *,
    group: str,
    topics: Sequence[str],
    interval_s: float = DEFAULT_INTERVAL_S,
) -> None:
    """Read the group's lag on ``topics`` every ``interval_s`` until cancelled."""
    if interval_s <= 0:
        raise ValueError(f"interval_s: must be > 0, got {interval_s}")
    reader = LagReader(config)
    failing = False
    try:
        while True:
            try:
                await reader.start()
                rows = await reader.group_lag(group, topics)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any broker trouble; the stage itself must carry on
                metrics.lag_failed(group)
                if not failing:
                    log.warning("reading lag of group %s failed (will retry): %s", group, exc)
                failing = True
                await reader.stop()
            else:
                metrics.set_lag(group, rows, time.time())
                if failing:
                    log.info("reading lag of group %s works again", group)
                failing = False
            await asyncio.sleep(interval_s)
    finally:
        await reader.stop()


class StageLagProbe:
    """Lag per stage (group total over its input partitions)."""

    def __init__(self, config: KafkaConfig, stages: Mapping[str, StageSpec] = STAGES) -> None:
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
            for name, spec in self.stages.items():
                rows = await self._reader.group_lag(spec.group, spec.inputs(self.config.names))
                result[name] = total_lag(rows)
            return result

    async def wait_for_zero(self, timeout_s: float, *, poll_s: float = 0.25) -> dict[str, int]:
        """Poll until every stage's lag is 0 or ``timeout_s`` passed; returns the last reading."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            reading = await self.read()
            if not any(reading.values()) or asyncio.get_running_loop().time() >= deadline:
                return reading
            await asyncio.sleep(poll_s)
