"""Request histories and replies of the four APIs as canonical turns, and digests over them.

A request's parent is the earlier call whose request history plus the reply the gateway
returned is the longest prefix of the new request's history. Agents send that reply back
re-serialized by their SDK (new ids, other spacing and key order, null fields added or
dropped), so histories are compared as canonical turns, built by these rules (the
contract; both sides of every comparison go through them):

- Content: a string, or a list of text parts (``{"type": "text" | "input_text" |
  "output_text", "text": ...}``), is the concatenation of the texts; ``None`` or absent
  content is ``""``. Refusal parts (``{"type": "refusal", "refusal": ...}``) and a chat
  assistant message's ``refusal`` count as text. Other parts (images, files) are refused.
- Tool-call arguments: a JSON string or an object is parsed and re-dumped with sorted
  keys and no whitespace; a string that does not parse is kept, stripped of surrounding
  whitespace; absent arguments are ``""``.
- Ignored: ids (tool_call ids, call_ids, tool_use ids), names of messages, statuses,
  annotations, cache controls, and whether a field is absent or null.
- Roles: ``"developer"`` counts as ``"system"``.
- Consecutive assistant pieces merge into one assistant turn (texts concatenated, tool
  calls appended): a Responses history lists a message item and function_call items one
  after another, and a reply may be made of several output items or content blocks.
- Tool results: a chat ``{"role": "tool"}`` message is one ``"tool"`` turn (its content's
  text); a Responses ``function_call_output`` item is one ``"tool"`` turn (its output's
  text); each Anthropic ``tool_result`` block of a user message is one ``"tool"`` turn (its
  content, a string or text blocks), followed by the rest of that message's text, if it
  has text blocks, as a ``"user"`` turn.
- Chat: ``messages[i]`` by role; an assistant's ``tool_calls[j].function.{name, arguments}``
  are its tool calls.
- Responses: ``instructions`` is a first ``"system"`` turn; ``input`` as a string is one
  ``"user"`` turn; items of type ``"message"``, or with a ``role`` and no type, are turns by
  role; a ``function_call`` is an assistant tool call (name, arguments); a
  ``function_call_output`` is a tool turn; ``reasoning`` items are ignored; any other item
  type is refused.
- Anthropic: the top-level ``system`` (a string or text blocks) is a first ``"system"``
  turn; ``tool_use`` blocks are tool calls (name, canonical ``input``); ``thinking`` and
  ``redacted_thinking`` blocks are ignored.
- Reasoning: an assistant turn's text is compared without its reasoning, since agent
  frameworks rewrite it before sending a reply back (drop it, move it between a
  reasoning field and ``<think>`` tags in the content, replace a tag by a blank line):
  every ``<think>...</think>`` block is removed, then everything up to a ``</think>``
  left without its opener (R1-style templates open the block in the prompt), then an
  unclosed ``<think>`` and all after it (reasoning cut short); the rest is stripped of
  surrounding whitespace. Reasoning fields (``reasoning``, ``reasoning_content``),
  ``reasoning`` items and ``thinking`` blocks are ignored. How the reasoning travelled
  is kept beside the turn (``Turn.reasoning``), outside its bytes, to count rewrites.
- Completions: the history is the prompt text itself, compared by character prefix.

A history that breaks these shapes raises `MalformedHistory` naming the field, so the
gateway answers 400 before anything is admitted.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from pipeline.api import sse
from topics.wire import Dialect

_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_CONVERSATION_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ROLES: dict[str, dict[str, str]] = {
    "chat": {**_CONVERSATION_ROLES, "tool": "tool"},
    "responses": _CONVERSATION_ROLES,
    "messages": {"user": "user", "assistant": "assistant"},
}
_IGNORED_BLOCKS = ("thinking", "redacted_thinking")
_REASONING_FIELDS = ("reasoning", "reasoning_content")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_OPEN, _CLOSE = "<think>", "</think>"
_DIGEST_SIZE = 16
_EMPTY_HISTORY = hashlib.blake2b(b"tokentrail-history", digest_size=_DIGEST_SIZE).digest()
_TEXT_PERSON = b"tokentrail-text"
_KWARGS_PERSON = b"tt-template-args"
TEMPLATE_KWARGS = "chat_template_kwargs"
_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete")
_BLOCK_DELTAS = {
    "text_delta": ("text", "text"),
    "input_json_delta": ("tool_use", "partial_json"),
}  # kind, field


class MalformedHistory(ValueError):
    """A history the gateway cannot normalize; ``param`` is the field's path, as in a 400."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _malformed(param: str, problem: str) -> MalformedHistory:
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


def _mapping(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _malformed(param, "must be an object")
    return value


def _list(value: Any, param: str) -> list[Any]:
    if value is None:
        raise _malformed(param, "is required")
    if not isinstance(value, list):
        raise _malformed(param, "must be a list")
    return value


def _optional_list(value: Any, param: str) -> list[Any]:
    return [] if value is None else _list(value, param)


def _optional_str(value: Any, param: str) -> str:
    """Null and absent read alike: agents' SDKs drop or add null fields freely."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _malformed(param, "must be a string")
    return value


def _role(dialect: str, value: Any, param: str) -> str:
    roles = _ROLES[dialect]
    if not isinstance(value, str) or value not in roles:
        raise _malformed(param, f"must be one of {', '.join(roles)}")
    return roles[value]


def _content_text(content: Any, param: str) -> str:
    """A string or text parts as one string: SDKs send the same text in either form."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _malformed(param, "must be a string or a list of text parts")
    return "".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, param: str) -> str:
    part = _mapping(part, param)
    kind = part.get("type")
    if not isinstance(kind, str) or kind not in _TEXT_KEYS:
        raise _malformed(f"{param}.type", f"unsupported content part type {kind!r} (text only)")
    key = _TEXT_KEYS[kind]
    return _optional_str(part.get(key), f"{param}.{key}")


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
        raise _malformed(param, "must be JSON") from None


def _call(name: Any, arguments: Any, param: str, name_param: str) -> tuple[str, str]:
    return _optional_str(name, name_param), _canonical_arguments(arguments, param)


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


def _canonical(turns: Iterable[Turn]) -> list[Turn]:
    """Merged turns, assistant texts without their reasoning (the module's rule)."""
    out = []
    for turn in _merged(turns):
        if turn.role == "assistant":
            text, kind = without_reasoning(turn.text)
            turn = Turn("assistant", text, turn.tool_calls, kind or turn.reasoning, turn.source)
        out.append(turn)
    return out


def _only_assistant(turns: Iterable[Turn], param: str) -> Turn:
    """A reply is one assistant turn, however many items it came in."""
    merged = _canonical(turns)
    if not merged:
        return Turn("assistant", "")
    if len(merged) > 1 or merged[0].role != "assistant":
        raise _malformed(param, "a reply holds assistant items only")
    return merged[0]


# --- Chat Completions -----------------------------------------------------------------


def _chat_turn(message: Any, param: str, role: str | None = None) -> Turn:
    message = _mapping(message, param)
    role = role or _role("chat", message.get("role"), f"{param}.role")
    text = _content_text(message.get("content"), f"{param}.content")
    if role != "assistant":
        return Turn(role, text)
    text += _optional_str(message.get("refusal"), f"{param}.refusal")
    reasoned = any(isinstance(message.get(name), str) and message.get(name) for name in _REASONING_FIELDS)
    calls = _chat_tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    return Turn(role, text, calls, "field" if reasoned else "")


def _chat_tool_calls(value: Any, param: str) -> tuple[tuple[str, str], ...]:
    calls = []
    for j, call in enumerate(_optional_list(value, param)):
        function = _mapping(_mapping(call, f"{param}[{j}]").get("function"), f"{param}[{j}].function")
        path = f"{param}[{j}].function"
        calls.append(
            _call(function.get("name"), function.get("arguments"), f"{path}.arguments", f"{path}.name")
        )
    return tuple(calls)


def _chat_request(body: Mapping[str, Any]) -> list[Turn]:
    messages = _list(body.get("messages"), "messages")
    return [replace(_chat_turn(message, f"messages[{i}]"), source=i) for i, message in enumerate(messages)]


def _choices(reply: Mapping[str, Any]) -> Iterator[tuple[int, Mapping[str, Any], str]]:
    """Each choice with its index (its ``index`` field, else its position) and its path."""
    for i, choice in enumerate(_list(reply.get("choices"), "choices")):
        param = f"choices[{i}]"
        choice = _mapping(choice, param)
        index = choice.get("index", i)
        if not isinstance(index, int) or isinstance(index, bool):
            raise _malformed(f"{param}.index", "must be an integer")
        yield index, choice, param


# --- Responses ------------------------------------------------------------------------


def _responses_items(items: list[Any], param: str) -> Iterator[Turn]:
    for i, item in enumerate(items):
        path = f"{param}[{i}]"
        item = _mapping(item, path)
        kind = item.get("type")
        if kind == "message" or (kind is None and "role" in item):
            role = _role("responses", item.get("role"), f"{path}.role")
            yield Turn(role, _content_text(item.get("content"), f"{path}.content"), source=i)
        elif kind == "function_call":
            call = _call(item.get("name"), item.get("arguments"), f"{path}.arguments", f"{path}.name")
            yield Turn("assistant", "", (call,), source=i)
        elif kind == "function_call_output":
            yield Turn("tool", _content_text(item.get("output"), f"{path}.output"), source=i)
        elif kind == "reasoning":
            yield Turn("assistant", "", reasoning="field", source=i)
        else:
            raise _malformed(f"{path}.type", f"unsupported item type {kind!r}")


def _responses_request(body: Mapping[str, Any]) -> list[Turn]:
    turns: list[Turn] = []
    instructions = body.get("instructions")
    if instructions is not None:
        turns.append(Turn("system", _optional_str(instructions, "instructions")))
    given = body.get("input")
    if isinstance(given, str):
        turns.append(Turn("user", given))
    else:
        turns.extend(_responses_items(_list(given, "input"), "input"))
    return turns


# --- Anthropic Messages ---------------------------------------------------------------


def _anthropic_assistant(blocks: list[Any], param: str) -> Turn:
    texts: list[str] = []
    calls: list[tuple[str, str]] = []
    reasoned = False
    for j, block in enumerate(blocks):
        path = f"{param}[{j}]"
        block = _mapping(block, path)
        kind = block.get("type")
        if kind == "text":
            texts.append(_optional_str(block.get("text"), f"{path}.text"))
        elif kind == "tool_use":
            calls.append(_call(block.get("name"), block.get("input"), f"{path}.input", f"{path}.name"))
        elif kind in _IGNORED_BLOCKS:
            reasoned = True
        else:
            raise _malformed(f"{path}.type", f"unsupported assistant block type {kind!r}")
    return Turn("assistant", "".join(texts), tuple(calls), "field" if reasoned else "")


def _anthropic_user(blocks: list[Any], param: str) -> list[Turn]:
    """Tool results first, one turn each, then the message's own text as a user turn."""
    turns: list[Turn] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        path = f"{param}[{j}]"
        block = _mapping(block, path)
        kind = block.get("type")
        if kind == "text":
            texts.append(_optional_str(block.get("text"), f"{path}.text"))
        elif kind == "tool_result":
            turns.append(Turn("tool", _content_text(block.get("content"), f"{path}.content")))
        else:
            raise _malformed(f"{path}.type", f"unsupported user block type {kind!r}")
    if texts or not turns:
        turns.append(Turn("user", "".join(texts)))
    return turns


def _anthropic_message(message: Any, param: str) -> list[Turn]:
    message = _mapping(message, param)
    role = _role("messages", message.get("role"), f"{param}.role")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return [Turn(role, content or "")]
    blocks = _list(content, f"{param}.content")
    if role == "assistant":
        return [_anthropic_assistant(blocks, f"{param}.content")]
    return _anthropic_user(blocks, f"{param}.content")


def _messages_request(body: Mapping[str, Any]) -> list[Turn]:
    turns: list[Turn] = []
    system = body.get("system")
    if system is not None:
        turns.append(Turn("system", _content_text(system, "system")))
    for i, message in enumerate(_list(body.get("messages"), "messages")):
        turns.extend(replace(turn, source=i) for turn in _anthropic_message(message, f"messages[{i}]"))
    return turns


# --- requests and replies -------------------------------------------------------------


def request_turns(dialect: Dialect, body: Mapping[str, Any]) -> list[Turn]:
    """The request's history as canonical turns; completions histories are text (`history_of`)."""
    if dialect == "chat":
        return _canonical(_chat_request(body))
    if dialect == "responses":
        return _canonical(_responses_request(body))
    if dialect == "messages":
        return _canonical(_messages_request(body))
    raise ValueError("completions histories are prompt text, not turns: use history_of")


def reply_turns(dialect: Dialect, reply: Mapping[str, Any]) -> dict[int, Turn]:
    """Each choice's reply (by choice index) as the assistant turn the agent will send back."""
    if dialect == "chat":
        return {
            index: _canonical([_chat_turn(choice.get("message"), f"{param}.message", role="assistant")])[0]
            for index, choice, param in _choices(reply)
        }
    if dialect == "completions":
        return {
            index: Turn("assistant", _optional_str(choice.get("text"), f"{param}.text"))
            for index, choice, param in _choices(reply)
        }
    if dialect == "responses":
        return {
            0: _only_assistant(_responses_items(_list(reply.get("output"), "output"), "output"), "output")
        }
    return {0: _canonical([_anthropic_assistant(_list(reply.get("content"), "content"), "content")])[0]}


# --- streamed replies -----------------------------------------------------------------


@dataclass(slots=True)
class _Piece:
    """A growing part of a streamed reply: a choice's text, a tool call, or a content block."""

    kind: str = ""
    name: str | None = None
    parts: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # a chat choice's refusal
    reasoning: list[str] = field(default_factory=list)  # a chat choice's reasoning deltas
    initial: Any = None  # an Anthropic tool_use block's input at its start
    calls: dict[int, _Piece] = field(default_factory=dict)  # a chat choice's tool calls


def _sse_messages(event: str) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """Each SSE message in ``event`` as (its event name, its JSON data); [DONE] and bad JSON skipped."""
    for message in sse.messages(event):
        parsed = message.json()
        if isinstance(parsed, dict):
            yield message.event, parsed


def _append(parts: list[str], value: Any) -> None:
    if isinstance(value, str):
        parts.append(value)


def _dicts(value: Any) -> Iterator[tuple[int, Mapping[str, Any]]]:
    if isinstance(value, list):
        for j, item in enumerate(value):
            if isinstance(item, Mapping):
                yield j, item


def _index(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class StreamedReply:
    """A streamed reply rebuilt into its turns, so a streaming call extends its history
    exactly as the same reply sent whole would.

    The stream is rebuilt into the non-streaming reply's shape and read by `reply_turns`.
    Events that do not parse are skipped: the agent's stream must never fail on lineage.
    """

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._pieces: dict[int, _Piece] = {}  # chat/completions: choices; messages: blocks
        self._response: Mapping[str, Any] | None = None

    def feed(self, event: str) -> None:
        """Take one SSE message as the worker sent it (``event:`` and ``data:`` lines)."""
        for name, data in _sse_messages(event):
            if self.dialect in ("chat", "completions"):
                self._on_choices(data)
            elif self.dialect == "responses":
                self._on_response(name or data.get("type"), data)
            else:
                self._on_message(name or data.get("type"), data)

    @property
    def final(self) -> Mapping[str, Any] | None:
        """The final response object of a Responses stream, once it arrived."""
        return self._response

    def turns(self) -> dict[int, Turn]:
        """Each choice's reply so far; a reply that cannot be normalized has none."""
        try:
            reply = self._reply()
            return {} if reply is None else reply_turns(self.dialect, reply)
        except MalformedHistory:
            return {}

    def _on_choices(self, data: Mapping[str, Any]) -> None:
        for j, choice in _dicts(data.get("choices")):
            piece = self._pieces.setdefault(_index(choice.get("index"), j), _Piece())
            if self.dialect == "completions":
                _append(piece.parts, choice.get("text"))
                continue
            delta = choice.get("delta")
            if not isinstance(delta, Mapping):
                continue
            _append(piece.parts, delta.get("content"))
            _append(piece.extra, delta.get("refusal"))
            for name in _REASONING_FIELDS:
                _append(piece.reasoning, delta.get(name))
            for k, fragment in _dicts(delta.get("tool_calls")):
                _on_call_fragment(
                    piece.calls.setdefault(_index(fragment.get("index"), k), _Piece()), fragment
                )

    def _on_response(self, name: Any, data: Mapping[str, Any]) -> None:
        response = data.get("response")
        if name in _FINAL_RESPONSE_EVENTS and isinstance(response, Mapping):
            self._response = response

    def _on_message(self, name: Any, data: Mapping[str, Any]) -> None:
        index = _index(data.get("index"), -1)
        block, delta = data.get("content_block"), data.get("delta")
        if index < 0:
            return
        if name == "content_block_start" and isinstance(block, Mapping):
            tool_name = block.get("name")
            piece = _Piece(
                str(block.get("type")),
                tool_name if isinstance(tool_name, str) else None,
                initial=block.get("input"),
            )
            _append(piece.parts, block.get("text") if piece.kind == "text" else None)
            self._pieces[index] = piece
        elif name == "content_block_delta" and isinstance(delta, Mapping):
            kind = delta.get("type")
            if isinstance(kind, str) and kind in _BLOCK_DELTAS:
                block_kind, key = _BLOCK_DELTAS[kind]
                _append(self._pieces.setdefault(index, _Piece(block_kind)).parts, delta.get(key))

    def _reply(self) -> Mapping[str, Any] | None:
        """The stream so far in the shape of the whole reply."""
        if self.dialect == "responses":
            return self._response
        if not self._pieces:
            return None
        if self.dialect == "completions":
            return {
                "choices": [{"index": i, "text": "".join(p.parts)} for i, p in sorted(self._pieces.items())]
            }
        if self.dialect == "chat":
            return {"choices": [_chat_choice(i, p) for i, p in sorted(self._pieces.items())]}
        return {"content": [_content_block(p) for _, p in sorted(self._pieces.items())]}


def _on_call_fragment(call: _Piece, fragment: Mapping[str, Any]) -> None:
    """The name comes with the first fragment that has one; arguments arrive in pieces."""
    function = fragment.get("function")
    if not isinstance(function, Mapping):
        return
    if call.name is None and isinstance(function.get("name"), str):
        call.name = function["name"]
    _append(call.parts, function.get("arguments"))


def _chat_choice(index: int, piece: _Piece) -> dict[str, Any]:
    calls = [
        {"function": {"name": call.name, "arguments": "".join(call.parts)}}
        for _, call in sorted(piece.calls.items())
    ]
    message = {
        "content": "".join(piece.parts),
        "refusal": "".join(piece.extra),
        "reasoning": "".join(piece.reasoning),
        "tool_calls": calls,
    }
    return {"index": index, "message": message}


def _content_block(piece: _Piece) -> dict[str, Any]:
    if piece.kind == "text":
        return {"type": "text", "text": "".join(piece.parts)}
    if piece.kind == "tool_use":  # no input deltas (or empty ones): the input the block started with
        arguments = "".join(piece.parts)
        return {
            "type": "tool_use",
            "name": piece.name,
            "input": arguments if arguments.strip() else piece.initial,
        }
    return {"type": piece.kind}


# --- digests --------------------------------------------------------------------------


def extend(digest: bytes, turn: Turn) -> bytes:
    """The digest of a history one turn longer: each digest commits to every turn before it."""
    return hashlib.blake2b(digest + turn.canonical(), digest_size=_DIGEST_SIZE).digest()


def turn_digests(turns: Sequence[Turn], start: bytes = _EMPTY_HISTORY) -> list[bytes]:
    """Element k identifies the first k turns, so any prefix is matched by one lookup;
    ``start`` is the empty history's digest (``template_start``)."""
    digests = [start]
    for turn in turns:
        digests.append(extend(digests[-1], turn))
    return digests


def template_start(body: Mapping[str, Any]) -> bytes:
    """The empty history's digest under the request's ``chat_template_kwargs``: a history
    rendered with other template variables (thinking switched off, ...) shares no prefix
    with this one, so a call that changes them starts a new root (DESIGN §13)."""
    kwargs = body.get(TEMPLATE_KWARGS)
    if kwargs is None or kwargs == {}:
        return _EMPTY_HISTORY
    if not isinstance(kwargs, Mapping):
        raise _malformed(TEMPLATE_KWARGS, "must be an object")
    canonical = orjson.dumps(kwargs, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(
        _EMPTY_HISTORY + canonical, digest_size=_DIGEST_SIZE, person=_KWARGS_PERSON
    ).digest()


def text_digest(text: str) -> bytes:
    """A completions history: its text, personalized apart from turn digests so kinds never collide."""
    data = text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE, person=_TEXT_PERSON).digest()


@dataclass(frozen=True, slots=True)
class History:
    """A request's history as lineage compares it: its length and the digest of any prefix."""

    kind: Literal["turns", "text"]
    length: int
    digests: tuple[bytes, ...] = ()
    text: str | None = None
    roles: tuple[str, ...] = ()
    """Each turn's role (turn histories): a recovered parent is found by a role, not a digest."""
    reasoning: tuple[str, ...] = ()
    """Each turn's ``Turn.reasoning``: how the agent sent reasoning back, for the rewrite counts."""
    sources: tuple[int, ...] = ()
    """Each turn's ``Turn.source``: where a left-out reply goes back into the request."""

    def __post_init__(self) -> None:
        if self.kind == "turns" and len(self.digests) != self.length + 1:
            raise ValueError(f"a history of {self.length} turns needs {self.length + 1} digests")
        if self.kind == "text" and (self.text is None or len(self.text) != self.length):
            raise ValueError(f"a text history of length {self.length} needs its text")

    def prefix_digest(self, length: int) -> bytes | None:
        """The digest of the first ``length`` turns (or characters); None past the end."""
        if not 0 <= length <= self.length:
            return None
        if self.kind == "turns":
            return self.digests[length]
        return text_digest((self.text or "")[:length])

    def role(self, index: int) -> str | None:
        """The role of turn ``index``, if there is such a turn."""
        return self.roles[index] if 0 <= index < len(self.roles) else None

    @property
    def start(self) -> bytes | None:
        """The empty history's digest (turn histories): it differs with the template variables."""
        return self.digests[0] if self.kind == "turns" else None

    @property
    def digest(self) -> bytes:
        """The digest of the whole history."""
        if self.kind == "turns":
            return self.digests[self.length]
        return text_digest(self.text or "")


def history_of(dialect: Dialect, body: Mapping[str, Any]) -> History:
    """A request's history; completions take a string prompt only (token-id prompts have no text)."""
    if dialect == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _malformed("prompt", "must be a string (token-id and batched prompts are not supported)")
        return History("text", len(prompt), (), prompt)
    turns = request_turns(dialect, body)
    digests = turn_digests(turns, template_start(body))
    return History(
        "turns",
        len(turns),
        tuple(digests),
        roles=tuple(turn.role for turn in turns),
        reasoning=tuple(turn.reasoning for turn in turns),
        sources=tuple(turn.source for turn in turns),
    )


def extended(history: History, reply: Turn) -> tuple[int, bytes]:
    """(length, digest) of the history followed by the reply: what a continuing request starts with."""
    if history.kind == "turns":
        return history.length + 1, extend(history.digest, reply)
    text = (history.text or "") + reply.text
    return len(text), text_digest(text)


__all__ = [
    "Dialect",
    "History",
    "MalformedHistory",
    "StreamedReply",
    "Turn",
    "extend",
    "extended",
    "history_of",
    "reply_turns",
    "request_turns",
    "text_digest",
    "turn_digests",
    "without_reasoning",
]
