"""Per-rollout quotas: one runaway agent cannot take the workers from the others.

Each session may have at most ``max_in_flight`` calls in flight, ``max_calls`` calls,
``max_tokens`` tokens (the sum over its calls of prompt plus generated tokens, from the
commit coords) and ``max_request_bytes`` of request bodies. A call over a limit is
answered 429 in the API's own shape naming the limit, before anything is admitted or
published, so the rollout stays capturable; refusals are counted per limit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Quotas:
    max_in_flight: int = 8
    max_calls: int = 10_000
    max_tokens: int = 100_000_000
    max_request_bytes: int = 2**32

    def __post_init__(self) -> None:
        for spec in fields(self):
            if getattr(self, spec.name) <= 0:
                raise ValueError(f"{spec.name}: must be > 0, got {getattr(self, spec.name)}")


@dataclass(slots=True)
class Usage:
    """What one session has used so far (in flight is the session's own count)."""

    calls: int = 0
    tokens: int = 0
    request_bytes: int = 0


class Metered(Protocol):
    """What a quota reads of a session (the gateway's ``Session`` is one); a protocol, so
    the quotas sit below the sessions that carry their usage."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def usage(self) -> Usage: ...


class QuotaExceeded(Exception):
    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message


class QuotaGuard:
    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas
        self.refused: Counter[str] = Counter()

    def check(self, session: Metered, request_bytes: int) -> None:
        """Raise ``QuotaExceeded`` naming the first limit this call would pass."""
        q, used = self.quotas, session.usage
        over = (
            ("max_in_flight", session.in_flight >= q.max_in_flight, f"{q.max_in_flight} calls in flight"),
            ("max_calls", used.calls >= q.max_calls, f"{q.max_calls} calls"),
            ("max_tokens", used.tokens >= q.max_tokens, f"{q.max_tokens} tokens"),
            (
                "max_request_bytes",
                used.request_bytes + request_bytes > q.max_request_bytes,
                f"{q.max_request_bytes} request bytes",
            ),
        )
        for limit, exceeded, what in over:
            if exceeded:
                self.refused[limit] += 1
                raise QuotaExceeded(limit, f"{limit}: rollout {session.rollout_id} is at its quota of {what}")

    @staticmethod
    def charge(session: Metered, request_bytes: int) -> None:
        session.usage.calls += 1
        session.usage.request_bytes += request_bytes


__all__ = ["Metered", "QuotaExceeded", "QuotaGuard", "Quotas", "Usage"]
