"""A dense, verifiable reward a tiny random model can raise in a few steps: the share of
digits in what it writes.

The arithmetic task's reward is sparse for a model that has never seen arithmetic (every
answer of a group earns about 0, so GRPO's advantages are 0 and nothing trains). Whether
the closed loop learns at all needs a reward every reply scores on a continuum and that
the policy can raise by shifting mass onto a set of tokens: the share of the non-blank
characters of its replies that are ASCII digits. A policy that writes only digits earns 1.
"""

from __future__ import annotations

from collections.abc import Iterable

DIGITS = frozenset("0123456789")


def digit_share(texts: Iterable[str]) -> float:
    """The share of non-blank characters of ``texts`` that are digits (0 for none)."""
    characters = [c for text in texts for c in text if not c.isspace()]
    return sum(c in DIGITS for c in characters) / len(characters) if characters else 0.0


__all__ = ["DIGITS", "digit_share"]
