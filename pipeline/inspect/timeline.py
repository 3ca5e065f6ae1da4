"""Throughput and rejections over time, from the finalized events' timestamps.

The run is cut into at most ``MAX_BUCKETS`` buckets of a round width (a second to a
day), so a minute-long test run and a day-long run both read at a glance; each bucket
counts the rollouts finalized in it, accepted and rejected by code.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from topics.records import FinalizedEvent

MAX_BUCKETS = 60
PALETTE = ("#b00020", "#e6550d", "#756bb1", "#fdae6b", "#636363", "#9e9ac8", "#843c39", "#bdbdbd")
"""Rejection codes' colours in the chart, most frequent code first (accepted: ``ACCEPTED``)."""
ACCEPTED = "#1f9e89"
WIDTHS_S = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)


@dataclass(slots=True)
class Bucket:
    start: float
    """Epoch seconds."""
    offset_s: float
    """Seconds from the first bucket's start."""
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    @property
    def finalized(self) -> int:
        return self.accepted + sum(self.rejected.values())


@dataclass(frozen=True, slots=True)
class Timeline:
    width_s: int
    buckets: list[Bucket]
    codes: list[str]
    """Every rejection code seen, most frequent first: the chart's stacking order."""

    colour_accepted = ACCEPTED

    def colour(self, code: str) -> str:
        return PALETTE[self.codes.index(code) % len(PALETTE)]

    def stack(self, bucket: Bucket) -> list[tuple[str, int, str]]:
        """(code, count, colour) of a bucket's rejections, in the same order in every bar."""
        return [(code, bucket.rejected[code], self.colour(code)) for code in self.codes]

    @property
    def peak(self) -> int:
        return max((b.finalized for b in self.buckets), default=0)

    @property
    def width(self) -> str:
        """The bucket width in words: ``30 s``, ``5 min``, ``1 h``."""
        if self.width_s % 3600 == 0:
            return f"{self.width_s // 3600} h"
        if self.width_s % 60 == 0:
            return f"{self.width_s // 60} min"
        return f"{self.width_s} s"


def utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3 h 20 min``: an offset into the run."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min" + (f" {whole % 60} s" if whole % 60 else "")
    return f"{whole // 3600} h" + (f" {whole % 3600 // 60} min" if whole % 3600 // 60 else "")


def bucket_width(span_s: float) -> int:
    """The smallest round width that cuts ``span_s`` into at most ``MAX_BUCKETS`` buckets."""
    return next((w for w in WIDTHS_S if span_s < w * MAX_BUCKETS), WIDTHS_S[-1])


def timeline(events: Iterable[FinalizedEvent]) -> Timeline:
    """Every finalized event in its bucket; empty buckets in between are kept (a stall shows)."""
    finalized = list(events)
    if not finalized:
        return Timeline(WIDTHS_S[0], [], [])
    first = min(e.finalized_at for e in finalized)
    last = max(e.finalized_at for e in finalized)
    width = bucket_width(last - first)
    origin = math.floor(first / width) * width
    buckets = [Bucket(origin + i * width, float(i * width)) for i in range(int((last - origin) // width) + 1)]
    codes: Counter[str] = Counter()
    for event in finalized:
        bucket = buckets[int((event.finalized_at - origin) // width)]
        if event.status == "accepted":
            bucket.accepted += 1
        else:
            code = str(event.rejection_reason)
            bucket.rejected[code] += 1
            codes[code] += 1
    return Timeline(width, buckets, [code for code, _ in codes.most_common()])
