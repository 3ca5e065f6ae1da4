"""A worker's capacity when nobody sets one: the batch its engine still serves at speed.

Fair shares (``slots``) need a capacity per worker, and no fixed number suits every engine:
on a GPU a decode step costs about the same at 1 and at 64 sequences, so one session alone
should keep dozens of calls running; on a CPU engine each sequence added slows every
step, so past a few calls a session's extra calls are paid for by everyone else's
latency. The engine's own bound (vLLM's ``max_num_seqs``, 128 or more) does not tell the
two apart; its measured step does. So the capacity is learned from the calls served:

- **The signal**: a call's seconds in its slot per generated token, an upper bound on the
  engine's step at the batch it ran in (its prefill and the transfer included).
- **The reference**: the fastest per-token time seen on the worker, its unloaded step.
- **The rule**, additive increase and multiplicative decrease as TCP's window: a call that
  ran with the worker full and kept within ``tolerance`` of the reference adds a slot (the
  engine still batches for free); a slower call halves the capacity, once per round (only
  a call granted after the last cut counts: the calls running then saw the old batch).
- **One call per session always runs**: a session holding no slot starts its call
  whatever the capacity (``FairSlots``), so a capacity of 1 costs polite, sequential
  sessions nothing; the capacity bounds how far one session goes past one call.

The tolerance of 0.5 is the latency a session beside a flooder may lose (1.5x unloaded);
where the engine slows past it with one call per session, that floor is all fairness can give.
Calls that report no token count teach nothing. No I/O and no clock here: the caller
measures and reports.
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = 0.5
"""How much slower than its fastest a worker's token may come before the batch counts as too large."""


def next_limit(limit: int, *, batch: int, per_token_s: float, fastest_s: float, tolerance: float) -> int:
    """The capacity after a call that ran in a batch of ``batch`` at ``per_token_s``: one more
    if the batch was full and still fast, half if slow, else unchanged (at least 1)."""
    if per_token_s <= fastest_s * (1 + tolerance):
        return limit + 1 if batch >= limit else limit
    return max(1, limit // 2)


@dataclass(slots=True)
class LearnedCapacity:
    """One worker's learned capacity (``limit``); ``observe`` takes each measured call."""

    limit: int = 1
    tolerance: float = TOLERANCE
    fastest_s: float | None = None
    """The fastest per-token time seen; None before the first call."""
    cut_after: int = 0
    """The grant number at the last cut: slower calls granted up to it are not counted again."""
    grants: int = 0
    """Calls granted a slot so far; each call's number is the count when it was granted."""

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"limit: must be >= 1, got {self.limit}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance: must be > 0, got {self.tolerance}")

    def granted(self) -> int:
        """Number the next call granted a slot."""
        self.grants += 1
        return self.grants

    def observe(self, *, number: int, batch: int, seconds: float, tokens: int) -> None:
        """A call (granted as ``number``, ``batch`` calls running with it) held its slot
        ``seconds`` and generated ``tokens``."""
        if tokens < 1 or seconds <= 0:
            return
        per_token_s = seconds / tokens
        self.fastest_s = per_token_s if self.fastest_s is None else min(self.fastest_s, per_token_s)
        if number <= self.cut_after:
            return
        limit = next_limit(
            self.limit,
            batch=batch,
            per_token_s=per_token_s,
            fastest_s=self.fastest_s,
            tolerance=self.tolerance,
        )
        if limit < self.limit:
            self.cut_after = self.grants
        self.limit = limit


__all__ = ["TOLERANCE", "LearnedCapacity", "next_limit"]
