"""Keeps ``tokentrail_consumer_lag`` fresh: the stage's group read every few seconds.

Lag is read here, off the consumer, with its own ``LagReader`` (its own connections),
so a slow or failing reading never delays a batch. A failure is counted and logged
once per outage, the connections are rebuilt, and the last good reading stays
exported (its timestamp says how old it is) — a lag panel must not drop to zero
because the broker was briefly unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.metrics import StageMetrics

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
