"""Staleness by pacing: hold a rollout back rather than drop its sample later.

Dropping stale samples biases against long rollouts; pacing admissions (AReaL's
max-staleness admission control) keeps stale samples from being produced at all. The
rule bounds production, not the age of what is in flight: the ``n``-th rollout admitted
(0-based) may start only once the trainer's policy version ``v`` satisfies

    n < (v - base + max_staleness + 1) * rollouts_per_step

where ``base`` is the version the first admission saw. Rollout ``n`` belongs to the
trainer's step ``n // rollouts_per_step + 1``, trained at version ``base + n //
rollouts_per_step``; it was admitted at a version at least that minus ``max_staleness``,
and every token it generates after admission has at least the version the worker served
then. So a trainer that takes its batches in admission order (``rollouts_per_step``
rollouts each) never sees a sample more than ``max_staleness`` versions behind, and
nothing is dropped. The looser "hold while the policy version is more than
``max_staleness`` ahead of the oldest rollout still generating" does not bound that:
finished rollouts are no longer in flight, so they pile up while a slow trainer drains
them, and each is trained later than the one before.

No I/O here: the run's loop and the gateway ask, and do the waiting themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


def admissible(index: int, policy_version: int, *, max_staleness: int, rollouts_per_step: int) -> bool:
    """Whether the ``index``-th admission (0-based, versions counted from the first's) may start."""
    return index < (policy_version + max_staleness + 1) * rollouts_per_step


@dataclass(slots=True)
class Pacer:
    """Counts admissions and refuses one that would run more than ``max_staleness`` ahead.

    ``held`` counts the refusals (a caller that retries is counted each time it is refused).
    """

    max_staleness: int
    rollouts_per_step: int
    admitted: int = 0
    held: int = 0
    base_version: int | None = None
    """The policy version the first admission saw; None until then."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.rollouts_per_step < 1:
            raise ValueError(f"rollouts_per_step: must be >= 1, got {self.rollouts_per_step}")

    def may_admit(self, policy_version: int) -> bool:
        """Whether the next admission may start now (it does not count it)."""
        base = policy_version if self.base_version is None else self.base_version
        return admissible(
            self.admitted,
            policy_version - base,
            max_staleness=self.max_staleness,
            rollouts_per_step=self.rollouts_per_step,
        )

    def admit(self, policy_version: int) -> bool:
        """Count the next admission if it may start now; else count it held and return False."""
        if not self.may_admit(policy_version):
            self.held += 1
            return False
        if self.base_version is None:
            self.base_version = policy_version
        self.admitted += 1
        return True


__all__ = ["Pacer", "admissible"]
