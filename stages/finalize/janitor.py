"""The staging janitor: rows that nobody else will delete go, driven by the log and a TTL.

The finalizer deletes a rollout's rows once its outcome is acknowledged, and a worker
deletes rows it writes after their rollout was finalized. What is left: rows of a
finalized rollout written by a worker that died before it could delete them, rows of
calls whose admission never reached the log (their rollout is never receipted), rows
staged again into a restarted data plane for a rollout finalized meanwhile. The janitor
sweeps the staging partition now and then: a row whose rollout this finalizer has
finalized goes at once; any other row goes once it has been seen for ``ttl_s``, longer
than a rollout may stay open (DESIGN §7.3).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from stages.ports import STAGING_PARTITION, DataPlane, DataPlaneError
from stages.recent import RecentIds

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JanitorConfig:
    ttl_s: float = 7200.0
    """A row not known finished goes after this long: above ``max_open_s`` plus the seal
    grace, so no rollout that can still be finalized loses a row."""
    sweep_every_s: float = 60.0
    max_keys: int = 10_000
    """Keys looked at per sweep, continuing where the last stopped: a sweep is bounded."""

    def __post_init__(self) -> None:
        for name in ("ttl_s", "sweep_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {self.max_keys}")


@dataclass(slots=True)
class JanitorStats:
    sweeps: int = 0
    finished: int = 0
    """Rows deleted because their rollout was finalized."""
    expired: int = 0
    """Rows deleted after the TTL."""
    errors: int = 0


class StagingJanitor:
    """Sweeps the staging partition on ``maybe_sweep`` (the finalizer's timer).

    Its clock is its own (monotonic wall time): the stage's log time stands still or
    jumps while the stage catches up, and a row's age is wall time."""

    def __init__(
        self,
        plane: DataPlane,
        finalized: RecentIds,
        config: JanitorConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plane = plane
        self.finalized = finalized
        self.config = config or JanitorConfig()
        self._clock = clock
        self.stats = JanitorStats()
        self._first_seen: dict[str, float] = {}
        self._after = ""  # the last key looked at: the next sweep starts past it
        self._next_sweep = -float("inf")

    async def maybe_sweep(self) -> None:
        """Sweep if ``sweep_every_s`` has passed since the last one."""
        if self._clock() < self._next_sweep:
            return
        self._next_sweep = self._clock() + self.config.sweep_every_s
        await self.sweep()

    async def sweep(self) -> None:
        now = self._clock()
        try:
            keys = await self.plane.list_keys(STAGING_PARTITION)
        except DataPlaneError as exc:
            self.stats.errors += 1
            log.warning("staging sweep skipped: %s", exc)
            return
        self.stats.sweeps += 1
        present = set(keys)
        self._first_seen = {k: t for k, t in self._first_seen.items() if k in present}
        window = self._window(sorted(keys))
        doomed: list[str] = []
        for key in window:
            rollout_id = key.split("/", 1)[0]
            if rollout_id in self.finalized:
                doomed.append(key)
                self.stats.finished += 1
            elif now - self._first_seen.setdefault(key, now) >= self.config.ttl_s:
                doomed.append(key)
                self.stats.expired += 1
        if not doomed:
            return
        try:
            await self.plane.delete_calls(doomed)
        except DataPlaneError as exc:
            self.stats.errors += 1
            log.warning("staging sweep could not delete %d row(s): %s", len(doomed), exc)
            return
        for key in doomed:
            self._first_seen.pop(key, None)
        log.info("staging sweep deleted %d row(s) nobody else would", len(doomed))

    def _window(self, keys: list[str]) -> list[str]:
        """Up to ``max_keys`` keys after the last one looked at, wrapping around."""
        if not keys:
            return []
        start = next((i for i, key in enumerate(keys) if key > self._after), 0)
        window = (keys[start:] + keys[:start])[: self.config.max_keys]
        self._after = window[-1] if len(window) < len(keys) else ""
        return window
