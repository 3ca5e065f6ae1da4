"""Pacing at the gateway: ``POST /rollouts`` answers 429 with ``Retry-After`` while the
trainer is too far behind what has been admitted (``stages.trainer.pacing``).

The trainer's policy version is the version the workers serve: its refit sets it through
each worker's ``/admin/weight_version``, and each worker's public ``/health`` reports it,
so pacing needs no new route and no credential of its own. The lowest version any worker
reports counts (a rollout may land on any of them). It is read again only when the
version already known would hold an admission back, at most every ``refresh_s``: a
version only grows, so the one known is never too generous.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from stages.trainer.pacing import Pacer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pacing:
    """``max_staleness`` versions of lead over the trainer, whose steps take ``rollouts_per_step``."""

    max_staleness: int
    rollouts_per_step: int
    retry_after_s: float = 1.0
    """What a held caller is told to wait (``Retry-After``, whole seconds, at least 1)."""
    refresh_s: float = 0.5
    """Read the workers' version at most this often."""

    def __post_init__(self) -> None:
        Pacer(self.max_staleness, self.rollouts_per_step)  # its checks, naming the field
        for name in ("retry_after_s", "refresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class Paced(Exception):
    """The admission is held back: answer 429 with ``Retry-After``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AdmissionPacer:
    """Counts the sessions the gateway opens and holds the next one while the workers'
    version is too far behind; ``held`` counts the 429s."""

    def __init__(
        self,
        pacing: Pacing,
        worker_urls: Callable[[], list[str]],
        http: httpx.AsyncClient,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pacing = pacing
        self.pacer = Pacer(pacing.max_staleness, pacing.rollouts_per_step)
        self._worker_urls = worker_urls
        self._http = http
        self._clock = clock
        self.version: int | None = None
        """The lowest version the workers reported last; None before the first reading."""
        self._read_at = -math.inf
        self._reading: asyncio.Lock = asyncio.Lock()

    @property
    def held(self) -> int:
        return self.pacer.held

    async def check(self) -> None:
        """Raise ``Paced`` unless a session may be opened now (it is not counted yet)."""
        if self.version is None or not self.pacer.may_admit(self.version):
            await self._refresh()
        if self.version is None:
            self.pacer.held += 1
            raise Paced("max_staleness: no worker reported its weight version; the trainer's is unknown")
        if not self.pacer.may_admit(self.version):
            self.pacer.held += 1
            raise Paced(
                f"max_staleness: {self.pacer.admitted} rollouts admitted, the trainer is at weight "
                f"version {self.version}: at most {self.pacing.max_staleness} version(s) ahead of it "
                f"with {self.pacing.rollouts_per_step} rollouts a step"
            )

    def opened(self) -> None:
        """Count the session just opened (after ``check`` let it through)."""
        assert self.version is not None
        self.pacer.admit(self.version)

    async def _refresh(self) -> None:
        async with self._reading:
            if self._clock() - self._read_at < self.pacing.refresh_s:
                return
            versions = await asyncio.gather(*(self._read(url) for url in self._worker_urls()))
            self._read_at = self._clock()
            known = [v for v in versions if v is not None]
            if known:
                self.version = min(known)

    async def _read(self, url: str) -> int | None:
        try:
            response = await self._http.get(f"{url}/health", timeout=5.0)
            version = response.json()["version"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("pacing: could not read %s's weight version: %s", url, exc)
            return None
        return version if isinstance(version, int) and version >= 0 else None


def optional_pacing(max_staleness: int | None, rollouts_per_step: int | None) -> Pacing | None:
    """``--max-staleness`` and ``--rollouts-per-step``: both (pacing), or neither (none)."""
    if max_staleness is None and rollouts_per_step is None:
        return None
    if max_staleness is None or rollouts_per_step is None:
        missing = "max-staleness" if max_staleness is None else "rollouts-per-step"
        raise ValueError(f"{missing}: pacing needs both --max-staleness and --rollouts-per-step")
    return Pacing(max_staleness=max_staleness, rollouts_per_step=rollouts_per_step)


__all__ = ["AdmissionPacer", "Paced", "Pacing", "optional_pacing"]
