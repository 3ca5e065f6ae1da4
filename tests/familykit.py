"""One tool-using episode spoken over any route, for the template-family matrix.

An episode is kept as chat messages and sent in the route's own shape (Chat, Responses,
Messages), streaming or not, through the official SDKs. Five calls: the model's replies
go back verbatim (so the gateway finds each parent from the history), and twice the
agent asks for a tool, calls it in the model's name and adds its result, as an agent
that runs tools itself does. ``FamilyReport`` gathers family x route -> result for the
README table.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
from enginekit import EngineHost, Rig

from pipeline.models.tiny import make_tiny_model
from stages.capture.vllm.engine import EngineSettings
from topics.records import CommitCoords
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

ROUTES = ("chat", "responses", "messages")
MAX_TOKENS = 6
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
SYSTEM = "You add numbers."
TOOL_REQUEST = "Use the add tool."
TOOL_RESULTS = ("RESULT-FIVE", "RESULT-TWENTY")
"""Distinctive tool outputs: a sample that holds both reached the engine with every turn."""
CALLS = 5

Message = dict[str, Any]
Extra = Callable[["Reply | None"], dict[str, Any]]
"""What a request adds to its body, given the reply before it (at the worker: the
admission continuing that reply's call; at the gateway: nothing)."""


def first_messages() -> list[Message]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]


def next_messages(turn: int, reply: str, *, tool_calls: bool = True) -> list[Message]:
    """What the agent appends after call ``turn`` (0-based) answered ``reply``; without
    ``tool_calls`` the tool's result comes in the user's words (a template that cannot
    render a tool call in the history)."""
    messages: list[Message] = [{"role": "assistant", "content": reply}]
    if turn in (0, 2) and not tool_calls:
        return [*messages, {"role": "user", "content": f"{TOOL_REQUEST} {TOOL_RESULTS[turn // 2]}"}]
    if turn in (0, 2):
        result = TOOL_RESULTS[turn // 2]
        call_id = f"call_{turn}"
        arguments = json.dumps({"a": 2, "b": 3 + turn})
        return [
            *messages,
            {"role": "user", "content": TOOL_REQUEST},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
    return [*messages, {"role": "user", "content": f"And {turn} more?"}]


@dataclass(frozen=True)
class FamilyEngine:
    """A family's tiny model and the engine serving it."""

    family: str
    model_dir: Path
    host: EngineHost


class FamilyEngines:
    """Each family's tiny model (seed 0) on its own engine, shared by every module that plays
    the family (the family matrix, the framework matrix): an engine start costs more than
    most of their tests. The ``keep`` most recently used stay open; the family matrix plays
    last the families the framework tests use, so those start once."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        self.root = root
        self.keep = keep
        self.open: collections.OrderedDict[str, FamilyEngine] = collections.OrderedDict()

    def engine(self, family: str) -> FamilyEngine:
        if family in self.open:
            self.open.move_to_end(family)
            return self.open[family]
        while len(self.open) >= self.keep:
            _, oldest = self.open.popitem(last=False)
            oldest.host.close()
        model_dir = self.root / family
        if not model_dir.exists():
            make_tiny_model(model_dir, template=family)  # type: ignore[arg-type]
        self.open[family] = FamilyEngine(family, model_dir, EngineHost(EngineSettings(model=str(model_dir))))
        return self.open[family]

    def close(self) -> None:
        while self.open:
            self.open.popitem()[1].host.close()


def admitting(rig: Rig, rollout_id: str, **extra: Any) -> Extra:
    """What a driver adds to each call's body: the admission continuing the reply before it
    (a root for the first), and ``extra``."""

    def admit(previous: Reply | None) -> dict[str, Any]:
        admission = rig.admit(rollout_id, None if previous is None else previous.coords())
        return {CAPTURE_FIELD: admission.model_dump(mode="json"), **extra}

    return admit


def worker_clients(url: str) -> dict[str, Any]:
    """The official SDKs pointed straight at a worker, as a driver speaks to it."""
    return {
        "openai_client": openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120),
        "anthropic_client": anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120),
    }


# ------------------------------------------------------------------ route shapes


def as_responses(messages: list[Message]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": message["content"],
                }
            )
        elif message.get("tool_calls"):
            for call in message["tool_calls"]:
                fn = call["function"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": fn["name"],
                        "arguments": fn["arguments"],
                    }
                )
        else:
            items.append({"role": message["role"], "content": message["content"]})
    return items


def as_anthropic(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    system, out = "", []
    for message in messages:
        if message["role"] == "system":
            system = message["content"]
        elif message["role"] == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message["tool_call_id"],
                "content": message["content"],
            }
            out.append({"role": "user", "content": [block]})
        elif message.get("tool_calls"):
            blocks = [
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"]),
                }
                for call in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return system, out


@dataclass
class Reply:
    text: str
    extra: dict[str, Any] | None
    """Where the coords would be: the reply's, or its final event's, extra fields."""

    def coords(self) -> CommitCoords:
        assert self.extra is not None and COORDS_FIELD in self.extra, self.extra
        return CommitCoords.model_validate(self.extra[COORDS_FIELD])


def send(
    route: str,
    stream: bool,
    messages: list[Message],
    extra: dict[str, Any],
    *,
    openai_client: openai.OpenAI | None = None,
    anthropic_client: anthropic.Anthropic | None = None,
) -> Reply:
    """One greedy call with the add tool on ``route``; the reply's text and extra fields."""
    if route == "chat":
        assert openai_client is not None
        return _chat(openai_client, stream, messages, extra)
    if route == "responses":
        assert openai_client is not None
        return _responses(openai_client, stream, messages, extra)
    assert route == "messages" and anthropic_client is not None
    return _messages(anthropic_client, stream, messages, extra)


def _chat(client: openai.OpenAI, stream: bool, messages: list[Message], extra: dict[str, Any]) -> Reply:
    tools = [
        {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_SCHEMA}}
    ]
    common: dict[str, Any] = {"model": "tiny", "messages": messages, "tools": tools, "extra_body": extra}
    if not stream:
        reply = client.chat.completions.create(temperature=0.0, max_tokens=MAX_TOKENS, **common)
        return Reply(reply.choices[0].message.content or "", reply.model_extra)
    text, final = "", None
    for chunk in client.chat.completions.create(
        temperature=0.0, max_tokens=MAX_TOKENS, stream=True, **common
    ):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                final = chunk
    assert final is not None
    return Reply(text, final.model_extra)


def _responses(client: openai.OpenAI, stream: bool, messages: list[Message], extra: dict[str, Any]) -> Reply:
    tools = [{"type": "function", "name": "add", "description": "a + b", "parameters": ADD_SCHEMA}]
    common: dict[str, Any] = {
        "model": "tiny",
        "input": as_responses(messages),
        "tools": tools,
        "temperature": 0.0,
        "max_output_tokens": MAX_TOKENS,
        "store": False,
        "extra_body": extra,
    }
    if not stream:
        response = client.responses.create(**common)
        return Reply(response.output_text, response.model_extra)
    completed = None
    for event in client.responses.create(stream=True, **common):
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None
    return Reply(completed.output_text, completed.model_extra)


def _messages(
    client: anthropic.Anthropic, stream: bool, messages: list[Message], extra: dict[str, Any]
) -> Reply:
    system, shaped = as_anthropic(messages)
    tools = [{"name": "add", "description": "a + b", "input_schema": ADD_SCHEMA}]
    # This SDK version has no typed temperature; the API's field is sent as it is.
    common: dict[str, Any] = {
        "model": "tiny",
        "system": system,
        "messages": shaped,
        "tools": tools,
        "max_tokens": MAX_TOKENS,
        "extra_body": {"temperature": 0.0, **extra},
    }
    if not stream:
        message = client.messages.create(**common)
        text = "".join(block.text for block in message.content if block.type == "text")
        return Reply(text, message.model_extra)
    text, delta = "", None
    for event in client.messages.create(stream=True, **common):
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
        if event.type == "message_delta":
            delta = event
    assert delta is not None
    return Reply(text, delta.model_extra)


def play(route: str, stream: bool, extra: Extra, *, tool_calls: bool = True, **clients: Any) -> list[Reply]:
    """The five calls of one episode; ``extra`` gives each request's added body fields."""
    messages = first_messages()
    replies: list[Reply] = []
    for turn in range(CALLS):
        reply = send(route, stream, messages, extra(replies[-1] if replies else None), **clients)
        replies.append(reply)
        messages += next_messages(turn, reply.text, tool_calls=tool_calls)
    return replies


# ------------------------------------------------------------------------- report


@dataclass
class FamilyReport:
    """(family, route, streaming) -> result for the README table, and the bad-input outcomes
    below it; an attempt not recorded failed."""

    results: dict[tuple[str, str, bool], str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def attempt(self, family: str, route: str, stream: bool) -> None:
        self.results[(family, route, stream)] = "**failed**"

    def record(self, family: str, route: str, stream: bool, result: str) -> None:
        self.results[(family, route, stream)] = result

    def note(self, case: str, outcome: str) -> None:
        self.notes[case] = outcome

    def markdown(self) -> str:
        """One row per family, one column per route; a cell is "not streaming / streaming"."""
        families = list(dict.fromkeys(family for family, _, _ in self.results))
        seen = list(dict.fromkeys(route for _, route, _ in self.results))
        routes = sorted(seen, key=lambda route: (not route.startswith("worker"), seen.index(route)))
        lines = ["| family | " + " | ".join(routes) + " |", "|---|" + "---|" * len(routes)] if routes else []
        for family in families:
            cells = [
                " / ".join(self.results.get((family, route, stream), "-") for stream in (False, True))
                for route in routes
            ]
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        if self.notes:
            lines.append("")
            lines += [f"- {case}: {outcome}" for case, outcome in self.notes.items()]
        return "\n".join(lines) + "\n"
