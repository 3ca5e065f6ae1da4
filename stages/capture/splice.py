"""Prefix splice (DESIGN §5): put the exact earlier tokens back under a re-rendered prompt.

A chat template re-renders earlier assistant turns from text, which can change their
tokens (reasoning stripped, different merges). The EOS tokens that close each turn
survive re-rendering, so the boundary is found by counting EOS tokens, not by
position: everything up to the last earlier turn's EOS is replaced by the exact ids
the model saw and produced. The count is checked against the exact prefix, which closes
one turn per EOS (its generation's own, or the one the splice adds): a template whose
history render closes another number of turns (it drops or merges earlier turns) does
not render the parent's tokens, and splicing it would misplace the boundary.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from topics.failures import WorkerFailure


class SpliceError(ValueError):
    """The splice cannot be made; ``code`` is always ``prefix_splice_failed``."""

    code = WorkerFailure.PREFIX_SPLICE_FAILED

    def __init__(self, reason: str) -> None:
        super().__init__(f"{self.code.value}: {reason}")
        self.reason = reason


def splice_prefix(
    exact_prefix_ids: Sequence[int],
    template_prefix_ids: Sequence[int],
    template_ids: Sequence[int],
    eos_token_ids: Collection[int],
) -> list[int]:
    """The prompt to send: exact prefix, one boundary EOS, then the new template tail.

    ``template_prefix_ids`` is the render of the conversation through the last assistant
    turn without a generation prompt; ``template_ids`` is the full render being sent.
    """
    if not eos_token_ids:
        raise SpliceError("no EOS token ids given")
    if not exact_prefix_ids:
        raise SpliceError("the exact prefix is empty")
    eos = frozenset(eos_token_ids)
    turns = sum(1 for token in template_prefix_ids if token in eos)
    if turns == 0:
        raise SpliceError("the partial render has no EOS, so no turn boundary can be found")
    boundary = _nth_eos_position(template_ids, eos, turns)
    if boundary is None:
        raise SpliceError(f"the full render has fewer than {turns} EOS tokens")
    return splice_at(exact_prefix_ids, template_ids, boundary, turns, eos)


def splice_at(
    exact_prefix_ids: Sequence[int],
    template_ids: Sequence[int],
    boundary: int,
    turns: int,
    eos_token_ids: Collection[int],
) -> list[int]:
    """The splice once the boundary is known: ``template_ids[boundary]`` closes the parent's
    turn, the ``turns``-th turn of the render.

    For renders whose history is a literal prefix of the full render (harmony), where the
    boundary is where that prefix ends rather than the ``turns``-th EOS.
    """
    if not exact_prefix_ids:
        raise SpliceError("the exact prefix is empty")
    if not 0 <= boundary < len(template_ids):
        raise SpliceError(f"the boundary {boundary} is outside the render of {len(template_ids)} tokens")
    eos = frozenset(eos_token_ids)
    closed = turns_closed(exact_prefix_ids, eos)
    if turns != closed:
        raise SpliceError(
            f"the history render closes {turns} turns but the exact prefix closes {closed}: "
            "the template does not render the parent's turns"
        )
    ended_on_eos = exact_prefix_ids[-1] in eos
    body = list(exact_prefix_ids[:-1] if ended_on_eos else exact_prefix_ids)
    boundary_eos = exact_prefix_ids[-1] if ended_on_eos else template_ids[boundary]
    # By construction the result starts with the exact prefix: body + boundary EOS is
    # the prefix itself when the model ended on EOS, and the prefix + one EOS otherwise.
    return [*body, boundary_eos, *template_ids[boundary + 1 :]]


def turns_closed(exact_prefix_ids: Sequence[int], eos_token_ids: Collection[int]) -> int:
    """Turns the exact prefix closes: one per EOS, plus its last if the generation stopped otherwise."""
    eos = frozenset(eos_token_ids)
    count = sum(1 for token in exact_prefix_ids if token in eos)
    return count if exact_prefix_ids and exact_prefix_ids[-1] in eos else count + 1


def _nth_eos_position(ids: Sequence[int], eos: frozenset[int], n: int) -> int | None:
    seen = 0
    for position, token in enumerate(ids):
        if token in eos:
            seen += 1
            if seen == n:
                return position
    return None
