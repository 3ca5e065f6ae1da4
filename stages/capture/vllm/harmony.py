"""The prefix splice (DESIGN §5) for harmony-format models (gpt-oss), on vLLM's own render.

vLLM renders a gpt-oss conversation with ``openai_harmony``, not a chat template: the
request becomes harmony messages, the analysis (reasoning) messages before the last final
answer are dropped, and the rest are rendered one after another. Rendering is a
concatenation of messages, so the history through the parent's turn is a literal prefix
of the prompt's render and the boundary is where that prefix ends; nothing has to be
counted to find it. What the render changes in the parent's turn is why the exact tokens
are put back: its last token (harmony writes ``<|end|>`` after a final answer the model
closed with ``<|return|>``), its reasoning once an answer followed it, and any text that
would tokenize otherwise.

The turns still have to agree: the exact prefix closes one turn per stop id it holds
(``<|return|>``, ``<|call|>``), and the history must hold as many assistant turns (runs of
assistant messages), or the request does not render the parent's turns (a turn of
reasoning alone, dropped once an answer followed it, or a reply the agent left out).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from openai_harmony import Role
from vllm.entrypoints.openai.parser.harmony_utils import auto_drop_analysis_messages, render_for_completion

from stages.capture.chat import starts_with_exact_prefix
from stages.capture.splice import SpliceError, splice_at, turns_closed


def harmony_spliced(
    exact_prefix: Sequence[int], messages: Sequence[Any], full: Sequence[int], stop_ids: Collection[int]
) -> list[int]:
    """The prompt to send: the exact prefix, then what ``full`` (vLLM's render of
    ``messages``) renders after the parent's turn.

    The parent's turn is the latest run of assistant messages whose history closes no more
    turns than the exact prefix (an agent may add assistant turns the engine never
    produced after it). A render that already starts with the whole exact prefix, ending
    on a stop id, is sent as it is. Raises ``SpliceError`` when no turn fits.
    """
    stops = frozenset(stop_ids)
    if not exact_prefix:
        raise SpliceError("the exact prefix is empty")
    if starts_with_exact_prefix(full, exact_prefix, stops):
        return list(full)
    kept = auto_drop_analysis_messages(list(messages))
    ends = assistant_turn_ends(kept)
    if not ends:
        raise SpliceError("a continuation needs an assistant turn in its messages")
    turns = min(turns_closed(exact_prefix, stops), len(ends))
    history = _history(kept[: ends[turns - 1]])
    if list(full[: len(history)]) != history:
        raise SpliceError("the history render is not the start of the prompt's render")
    return splice_at(exact_prefix, full, len(history) - 1, turns, stops)


def assistant_turn_ends(messages: Sequence[Any]) -> list[int]:
    """Where each run of assistant messages ends (exclusive), in order: one per turn."""
    ends: list[int] = []
    for index, message in enumerate(messages):
        mine = message.author.role == Role.ASSISTANT
        following = index + 1 < len(messages) and messages[index + 1].author.role == Role.ASSISTANT
        if mine and not following:
            ends.append(index + 1)
    return ends


def _history(messages: Sequence[Any]) -> list[int]:
    """vLLM's render of ``messages`` without the generation prompt it ends with."""
    rendered = [int(token) for token in render_for_completion(list(messages))]
    prompt = [int(token) for token in render_for_completion([])]
    if rendered[-len(prompt) :] != prompt:
        raise SpliceError("harmony's render does not end with the assistant's generation prompt")
    return rendered[: -len(prompt)]


__all__ = ["assistant_turn_ends", "harmony_spliced"]
