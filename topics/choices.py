"""Requests that sample several choices (``n`` > 1): one admitted call per choice.

A driver that asks for ``n`` choices either sends one admission, whose choices become
the sibling calls ``{call_id}.{i}`` of the same parent, or a list of ``n`` admissions on
one prefix (choice ``i`` is the ``i``-th: root calls may then sit in ``n`` rollouts of
one group, a GRPO group from one request). Either way the driver publishes the
per-choice admissions itself, so the ledger sees ordinary calls.
"""

from __future__ import annotations

from collections.abc import Sequence

from topics.records import CaptureAdmission


def choice_call_id(call_id: str, index: int) -> str:
    """The call id of choice ``index`` of a request admitted as ``call_id``."""
    return f"{call_id}.{index}"


def choice_admissions(admission: CaptureAdmission, n: int) -> list[CaptureAdmission]:
    """The admission itself for ``n`` == 1, else one sibling admission per choice."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if n == 1:
        return [admission]
    return [admission.model_copy(update={"call_id": choice_call_id(admission.call_id, i)}) for i in range(n)]


def check_shared_prefix(admissions: Sequence[CaptureAdmission]) -> None:
    """Every choice is generated from one prompt, so every admission must name the same prefix.

    Raises ``ValueError`` naming the first admission (by index) that differs, or a
    repeated call.
    """
    first = admissions[0]
    seen: set[str] = set()
    for index, admission in enumerate(admissions):
        key = admission.staging_key
        if key in seen:
            raise ValueError(f"[{index}].call_id: {key} is admitted twice")
        seen.add(key)
        if (
            admission.mode != first.mode
            or admission.prev_len != first.prev_len
            or admission.staging_chain != first.staging_chain
            or admission.parent_chain_hash != first.parent_chain_hash
            or admission.history != first.history
        ):
            raise ValueError(f"[{index}]: every choice must continue the prefix of [0]")
