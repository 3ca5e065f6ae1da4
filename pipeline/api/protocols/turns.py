"""Canonical turns: the rules every protocol's histories and replies are compared under.

A request's parent is the earlier call whose request history plus the reply the gateway
returned is the longest prefix of the new request's history. Agents send that reply back
re-serialized by their SDK (new ids, other spacing and key order, null fields added or
dropped), so histories are compared as canonical turns. These rules are shared by every
protocol (each protocol's module says how its own shapes map onto turns); both sides of
every comparison go through them:

- Content: a string, or a list of text parts (``{"type": "text" | "input_text" |
  "output_text", "text": ...}``), is the concatenation of the texts; ``None`` or absent
  content is ``""``. Refusal parts (``{"type": "refusal", "refusal": ...}``) count as
  text. Other parts (images, files) are refused.
- Tool-call arguments: a JSON string or an object is parsed and re-dumped with sorted
  keys and no whitespace; a string that does not parse is kept, stripped of surrounding
  whitespace; absent arguments are ``""``.
- Ignored: ids (tool_call ids, call_ids, tool_use ids), names of messages, statuses,
  annotations, cache controls, and whether a field is absent or null.
- Roles: ``"developer"`` counts as ``"system"``.
- Consecutive assistant pieces merge into one assistant turn (texts concatenated, tool
  calls appended): a history may list a message and its tool calls one after another,
  and a reply may be made of several output items or content blocks.
- Reasoning: an assistant turn's text is compared without its reasoning, since agent
  frameworks rewrite it before sending a reply back (drop it, move it between a
  reasoning field and ``<think>`` tags in the content, replace a tag by a blank line):
  every ``<think>...</think>`` block is removed, then everything up to a ``</think>``
  left without its opener (R1-style templates open the block in the prompt), then an
  unclosed ``<think>`` and all after it (reasoning cut short); the rest is stripped of
  surrounding whitespace. Reasoning fields, items and blocks are ignored. How the
  reasoning travelled is kept beside the turn (``Turn.reasoning``), outside its bytes,
  to count rewrites.

A history that breaks these shapes raises `MalformedHistory` naming the field, so the
gateway answers 400 before anything is admitted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
CONVERSATION_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
REASONING_FIELDS = ("reasoning", "reasoning_content")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_OPEN, _CLOSE = "<think>", "</think>"


class MalformedHistory(ValueError):
    """A history the gateway cannot normalize; ``param`` is the field's path, as in a 400."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def malformed(param: str, problem: str) -> MalformedHistory:
    return MalformedHistory(param, f"{param}: {problem}")


@dataclass(frozen=True, slots=True)
class Turn:
    """One normalized turn: what two histories must agree on to be the same conversation."""

    role: str
    text: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    reasoning: str = field(default="", compare=False)
    """How an assistant turn carried reasoning: ``field`` (a reasoning field, item or block),
    ``tags`` (``<think>`` blocks in its text), ``closing`` (a ``</think>`` without its
    opener), ``unclosed``, or "" (none). Not part of the turn's bytes."""
    source: int = field(default=-1, compare=False)
    """The index of the request's list element (chat or Anthropic message, Responses input
    item) the turn starts in; -1 outside the list. Not part of the turn's bytes."""

    @property
    def empty(self) -> bool:
        """No text and no tool calls: a reply of reasoning alone, which agents may leave out."""
        return not self.text and not self.tool_calls

    def canonical(self) -> bytes:
        """A fixed list layout, so a turn's bytes (and every digest over them) never drift."""
        calls = [[name, arguments] for name, arguments in self.tool_calls]
        return orjson.dumps([self.role, self.text, calls])


# --- shapes ---------------------------------------------------------------------------


def mapping(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise malformed(param, "must be an object")
    return value


def required_list(value: Any, param: str) -> list[Any]:
    if value is None:
        raise malformed(param, "is required")
    if not isinstance(value, list):
        raise malformed(param, "must be a list")
    return value


def optional_list(value: Any, param: str) -> list[Any]:
    return [] if value is None else required_list(value, param)


def optional_str(value: Any, param: str) -> str:
    """Null and absent read alike: agents' SDKs drop or add null fields freely."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise malformed(param, "must be a string")
    return value


def role(roles: Mapping[str, str], value: Any, param: str) -> str:
    """The canonical role of ``value`` under a protocol's table of roles."""
    if not isinstance(value, str) or value not in roles:
        raise malformed(param, f"must be one of {', '.join(roles)}")
    return roles[value]


def content_text(content: Any, param: str) -> str:
    """A string or text parts as one string: SDKs send the same text in either form."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise malformed(param, "must be a string or a list of text parts")
    return "".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, param: str) -> str:
    part = mapping(part, param)
    kind = part.get("type")
    if not isinstance(kind, str) or kind not in _TEXT_KEYS:
        raise malformed(f"{param}.type", f"unsupported content part type {kind!r} (text only)")
    key = _TEXT_KEYS[kind]
    return optional_str(part.get(key), f"{param}.{key}")


def _canonical_arguments(arguments: Any, param: str) -> str:
    """Sorted, compact JSON: agents re-serialize arguments with their own spacing and order."""
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = orjson.loads(text)
        except orjson.JSONDecodeError:
            return text.strip()
    try:
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError:
        raise malformed(param, "must be JSON") from None


def tool_call(name: Any, arguments: Any, param: str, name_param: str) -> tuple[str, str]:
    """A tool call as a turn holds it: its name and its canonical arguments."""
    return optional_str(name, name_param), _canonical_arguments(arguments, param)


# --- canonical turns ------------------------------------------------------------------


def _merged(turns: Iterable[Turn]) -> list[Turn]:
    """Consecutive assistant pieces as one turn: how they are split is the API's, not the model's."""
    out: list[Turn] = []
    for turn in turns:
        if out and turn.role == "assistant" and out[-1].role == "assistant":
            last = out[-1]
            out[-1] = Turn(
                "assistant",
                last.text + turn.text,
                last.tool_calls + turn.tool_calls,
                last.reasoning or turn.reasoning,
                last.source,
            )
        else:
            out.append(turn)
    return out


def without_reasoning(text: str) -> tuple[str, str]:
    """The text with its reasoning removed (the module's rule), and how it was written there."""
    kind = ""
    if _OPEN in text or _CLOSE in text:
        kept, blocks = _THINK_BLOCK.subn("", text)
        kind = "tags" if blocks else ""
        if _CLOSE in kept:
            kept, kind = kept.rsplit(_CLOSE, 1)[1], "closing"
        if _OPEN in kept:
            kept, kind = kept.split(_OPEN, 1)[0], "unclosed"
        text = kept
    return text.strip(), kind


def canonical(turns: Iterable[Turn]) -> list[Turn]:
    """Merged turns, assistant texts without their reasoning (the module's rule)."""
    out = []
    for turn in _merged(turns):
        if turn.role == "assistant":
            text, kind = without_reasoning(turn.text)
            turn = Turn("assistant", text, turn.tool_calls, kind or turn.reasoning, turn.source)
        out.append(turn)
    return out


def only_assistant(turns: Iterable[Turn], param: str) -> Turn:
    """A reply is one assistant turn, however many items it came in."""
    merged = canonical(turns)
    if not merged:
        return Turn("assistant", "")
    if len(merged) > 1 or merged[0].role != "assistant":
        raise malformed(param, "a reply holds assistant items only")
    return merged[0]


__all__ = [
    "CONVERSATION_ROLES",
    "REASONING_FIELDS",
    "MalformedHistory",
    "Turn",
    "canonical",
    "content_text",
    "malformed",
    "mapping",
    "only_assistant",
    "optional_list",
    "optional_str",
    "required_list",
    "role",
    "tool_call",
    "without_reasoning",
]
