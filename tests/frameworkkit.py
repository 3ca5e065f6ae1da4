"""Agent frameworks and the official SDKs playing one tool-using episode through the gateway.

Each agent is given only what a session hands out (a base URL and a key) and plays the same
three calls: a question; a request for the add tool, the call and its result (the agent's
own code adds the call, since a random model never makes one; the framework runs the tool
where it can); a follow-up. ``Tap`` keeps every model call a framework made and what came
back, and can make a reply cut at ``max_tokens`` read as finished (pydantic-ai and
openai-agents refuse a token budget spent before any output). Shared by the framework
matrix (``tests/frameworks``) and the model matrix (``tests/models``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import agents
import anthropic
import httpx2
import openai
import orjson
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI
from pydantic_ai import Agent, ModelSettings, Tool
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, ToolCallPart, UserPromptPart
from pydantic_ai.models import Model
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

SYSTEM = "You add numbers."
QUESTION = "What is 2 + 3?"
TOOL_REQUEST = "Use the add tool."
FOLLOW_UP = "And 4 more?"
ADD_ARGS = {"a": 2, "b": 3}
CALL_ID = "call_add"
MAX_TOKENS = 12
CALLS = 3
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
# This SDK's default API version makes pydantic-ai drop temperature (a newer Anthropic API
# rejects sampling options); the oracle needs greedy replies, so the older one is named.
ANTHROPIC_VERSION = {"anthropic-version": "2023-06-01"}
EXACT = "one chain, accepted, exact"


def add(a: int, b: int) -> str:
    """Add two numbers."""
    return f"{a} + {b} = {a + b}"


TOOL_RESULT = add(**ADD_ARGS)
"""Distinctive: a sample holding it reached the engine with the tool turn."""


class BrokenChain(AssertionError):
    """The session's calls are not one chain: some call's history did not continue the last."""


class RefusedHistory(AssertionError):
    """A call was refused (4xx) for the history the framework sent."""


# ------------------------------------------------------------------------------ the wire

MODEL_ROUTES = ("/chat/completions", "/responses", "/messages")
_BODY_HEADERS = {"content-length", "content-encoding", "transfer-encoding"}
_FINISHED = (
    (re.compile(rb'"finish_reason":\s*"length"'), b'"finish_reason":"stop"'),
    (re.compile(rb'"stop_reason":\s*"max_tokens"'), b'"stop_reason":"end_turn"'),
    (re.compile(rb'"status":\s*"incomplete"'), b'"status":"completed"'),
    (re.compile(rb'"incomplete_details":\s*\{[^{}]*\}'), b'"incomplete_details":null'),
    (re.compile(rb"response\.incomplete"), b"response.completed"),
)


@dataclass
class Exchange:
    """One model call as the framework made it, and the reply as the gateway returned it."""

    request: dict[str, Any]
    status: int
    reply: bytes


class Tap:
    """Every model call a framework makes and what came back; with ``finished``, a reply cut
    at ``max_tokens`` reaches the framework as finished (its finish reason alone changes)."""

    def __init__(self, *, finished: bool = False) -> None:
        self.finished = finished
        self.exchanges: list[Exchange] = []

    def keep(self, request: httpx2.Request, response: httpx2.Response, body: bytes) -> httpx2.Response:
        if request.method == "POST" and request.url.path.endswith(MODEL_ROUTES):
            self.exchanges.append(Exchange(orjson.loads(request.content), response.status_code, body))
        if self.finished and response.status_code == 200:
            for pattern, replacement in _FINISHED:
                body = pattern.sub(replacement, body)
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _BODY_HEADERS]
        return httpx2.Response(response.status_code, headers=headers, content=body, request=request)

    def client(self) -> httpx2.Client:
        return httpx2.Client(transport=_SyncTap(self), timeout=120)

    def async_client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=_AsyncTap(self), timeout=120)

    def refused(self) -> tuple[int, Exchange] | None:
        """The first call answered with a client error, and its index."""
        for index, exchange in enumerate(self.exchanges):
            if 400 <= exchange.status < 500:
                return index, exchange
        return None


class _SyncTap(httpx2.BaseTransport):
    def __init__(self, tap: Tap) -> None:
        self.tap, self.inner = tap, httpx2.HTTPTransport()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        try:
            body = response.read()
        finally:
            response.close()
        return self.tap.keep(request, response, body)

    def close(self) -> None:
        self.inner.close()


class _AsyncTap(httpx2.AsyncBaseTransport):
    def __init__(self, tap: Tap) -> None:
        self.tap, self.inner = tap, httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        return self.tap.keep(request, response, body)

    async def aclose(self) -> None:
        await self.inner.aclose()


def history_of(exchange: Exchange) -> Any:
    return exchange.request.get("messages", exchange.request.get("input"))


def reply_of(exchange: Exchange) -> Any:
    """The reply's message, output items or content blocks (reassembled when streamed)."""
    if exchange.reply.lstrip().startswith(b"{"):
        body = orjson.loads(exchange.reply)
        if "choices" in body:
            return body["choices"][0]["message"]
        return body["output"] if "output" in body else body.get("content", body)
    events = [
        orjson.loads(line[5:])
        for line in exchange.reply.splitlines()
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]")
    ]
    merged: dict[str, Any] = {}
    for event in events:
        if event.get("type") in ("response.completed", "response.incomplete"):
            return event["response"]["output"]
        for choice in event.get("choices") or ():
            for key, value in (choice.get("delta") or {}).items():
                if isinstance(value, str):
                    merged[key] = merged.get(key, "") + value
    return merged


def compact(value: Any, limit: int = 900) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[:limit] + "..."


def what_went_back(exchanges: list[Exchange], index: int) -> str:
    """Call ``index``'s history as the framework sent it, beside the reply before it."""
    return (
        f"call {index + 1} sent the history {compact(history_of(exchanges[index]))}; "
        f"the reply to call {index} was {compact(reply_of(exchanges[index - 1]))}"
    )


# ------------------------------------------------------------------------------ the agents

Opened = dict[str, Any]
"""What ``POST /rollouts`` handed out: base_url, anthropic_base_url, api_key."""


def tool_call_turns() -> list[dict[str, Any]]:
    """The user's request for the tool, the call, and its result, as chat messages."""
    call = {"id": CALL_ID, "type": "function", "function": {"name": "add", "arguments": json.dumps(ADD_ARGS)}}
    return [
        {"role": "user", "content": TOOL_REQUEST},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": add(**ADD_ARGS)},
    ]


def tool_call_items() -> list[dict[str, Any]]:
    """The same turns as Responses input items."""
    return [
        {"role": "user", "content": TOOL_REQUEST},
        {"type": "function_call", "call_id": CALL_ID, "name": "add", "arguments": json.dumps(ADD_ARGS)},
        {"type": "function_call_output", "call_id": CALL_ID, "output": add(**ADD_ARGS)},
    ]


def pydantic_ai_agent(kind: str) -> Callable[[Opened, Tap], None]:
    """pydantic-ai's agent on its ``kind`` model; it runs the add call itself."""

    def play(opened: Opened, tap: Tap) -> None:
        async def episode() -> None:
            async with tap.async_client() as http:
                model: Model
                headers: dict[str, str] = {}
                if kind == "anthropic":
                    provider = AnthropicProvider(
                        base_url=opened["anthropic_base_url"], api_key=opened["api_key"], http_client=http
                    )
                    model, headers = AnthropicModel("tiny", provider=provider), ANTHROPIC_VERSION
                else:
                    openai_provider = OpenAIProvider(
                        base_url=opened["base_url"], api_key=opened["api_key"], http_client=http
                    )
                    chosen = OpenAIChatModel if kind == "chat" else OpenAIResponsesModel
                    model = chosen("tiny", provider=openai_provider)
                settings = ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS, extra_headers=headers)
                # None is a valid output: a reply of reasoning alone ends a run.
                agent = Agent(
                    model,
                    output_type=str | None,  # type: ignore[arg-type]
                    system_prompt=SYSTEM,
                    tools=[Tool(add, takes_ctx=False)],
                    model_settings=settings,
                )
                first = await agent.run(QUESTION)
                asked: list[ModelMessage] = [
                    *first.all_messages(),
                    ModelRequest(parts=[UserPromptPart(TOOL_REQUEST)]),
                    ModelResponse(parts=[ToolCallPart("add", dict(ADD_ARGS), tool_call_id=CALL_ID)]),
                ]
                second = await agent.run(None, message_history=asked)  # runs add, then asks the model
                await agent.run(FOLLOW_UP, message_history=second.all_messages())

        asyncio.run(episode())

    return play


def openai_agents_agent(kind: str, stream: bool) -> Callable[[Opened, Tap], None]:
    """openai-agents' runner on its ``kind`` model, plain or streamed, tracing off."""

    def play(opened: Opened, tap: Tap) -> None:
        agents.set_tracing_disabled(True)

        async def episode() -> None:
            async with tap.async_client() as http:
                client = openai.AsyncOpenAI(
                    base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, http_client=http
                )
                model: agents.Model = (
                    agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
                    if kind == "chat"
                    else agents.OpenAIResponsesModel(model="tiny", openai_client=client)
                )
                agent = agents.Agent(
                    name="adder",
                    instructions=SYSTEM,
                    model=model,
                    tools=[agents.function_tool(add)],
                    model_settings=agents.ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS),
                )

                async def run(items: list[Any]) -> list[Any]:
                    if stream:
                        streamed = agents.Runner.run_streamed(agent, items)
                        async for _ in streamed.stream_events():
                            pass
                        return list(streamed.to_input_list())
                    result = await agents.Runner.run(agent, items)
                    return list(result.to_input_list())

                items = await run([{"role": "user", "content": QUESTION}])
                items = await run([*items, *tool_call_items()])
                await run([*items, {"role": "user", "content": FOLLOW_UP}])

        asyncio.run(episode())

    return play


def langchain_agent(opened: Opened, tap: Tap) -> None:
    """LangChain's ChatOpenAI with the add tool bound; LangChain runs the call itself."""
    adder = langchain_tool(add)
    with tap.client() as http:
        llm = ChatOpenAI(
            model="tiny",
            base_url=opened["base_url"],
            api_key=opened["api_key"],
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            max_retries=0,
            http_client=http,
        ).bind_tools([adder])
        messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
        messages.append(llm.invoke(messages))
        call = {"name": "add", "args": dict(ADD_ARGS), "id": CALL_ID, "type": "tool_call"}
        messages += [HumanMessage(TOOL_REQUEST), AIMessage(content="", tool_calls=[call])]
        messages.append(adder.invoke(call))  # a ToolMessage
        messages.append(llm.invoke(messages))
        llm.invoke([*messages, HumanMessage(FOLLOW_UP)])


def sdk_chat_agent(opened: Opened, tap: Tap) -> None:
    """The openai SDK's chat loop: each reply's message object goes back as it came."""
    tools: list[Any] = [
        {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_SCHEMA}}
    ]
    with tap.client() as http:
        client = openai.OpenAI(
            base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, http_client=http
        )
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        for added in (tool_call_turns(), [{"role": "user", "content": FOLLOW_UP}], None):
            reply = client.chat.completions.create(
                model="tiny", messages=messages, tools=tools, temperature=0.0, max_tokens=MAX_TOKENS
            )
            messages += [reply.choices[0].message, *(added or ())]


def sdk_responses_agent(opened: Opened, tap: Tap) -> None:
    """The openai SDK's Responses loop: each reply's output items go back as they came."""
    tools: list[Any] = [{"type": "function", "name": "add", "description": "a + b", "parameters": ADD_SCHEMA}]
    with tap.client() as http:
        client = openai.OpenAI(
            base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, http_client=http
        )
        items: list[Any] = [{"role": "user", "content": QUESTION}]
        for added in (tool_call_items(), [{"role": "user", "content": FOLLOW_UP}], None):
            reply = client.responses.create(
                model="tiny",
                instructions=SYSTEM,
                input=items,
                tools=tools,
                temperature=0.0,
                max_output_tokens=MAX_TOKENS,
                store=False,
            )
            items += [*reply.output, *(added or ())]


def sdk_messages_agent(opened: Opened, tap: Tap) -> None:
    """The anthropic SDK's loop: each reply's content blocks go back as they came."""
    tools: list[Any] = [{"name": "add", "description": "a + b", "input_schema": ADD_SCHEMA}]
    called = [
        {"role": "user", "content": TOOL_REQUEST},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": CALL_ID, "name": "add", "input": ADD_ARGS}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": TOOL_RESULT}],
        },
    ]
    with tap.client() as http:
        client = anthropic.Anthropic(
            base_url=opened["anthropic_base_url"], api_key=opened["api_key"], max_retries=0, http_client=http
        )
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        for added in (called, [{"role": "user", "content": FOLLOW_UP}], None):
            # This SDK version has no typed temperature; the API's field is sent as it is.
            reply = client.messages.create(
                model="tiny",
                system=SYSTEM,
                messages=messages,
                tools=tools,
                max_tokens=MAX_TOKENS,
                extra_body={"temperature": 0.0},
            )
            messages += [{"role": "assistant", "content": reply.content}, *(added or ())]


# ------------------------------------------------------------------------------ the matrix


@dataclass(frozen=True)
class Case:
    play: Callable[[Opened, Tap], None]
    finished: bool = False
    """Whether the framework sees cut replies as finished (it refuses them otherwise)."""


CASES: dict[str, Case] = {
    "pydantic-ai chat": Case(pydantic_ai_agent("chat"), finished=True),
    "pydantic-ai responses": Case(pydantic_ai_agent("responses"), finished=True),
    "pydantic-ai anthropic": Case(pydantic_ai_agent("anthropic"), finished=True),
    "openai-agents chat": Case(openai_agents_agent("chat", False), finished=True),
    "openai-agents chat, streamed": Case(openai_agents_agent("chat", True), finished=True),
    "openai-agents responses": Case(openai_agents_agent("responses", False), finished=True),
    "openai-agents responses, streamed": Case(openai_agents_agent("responses", True), finished=True),
    "langchain ChatOpenAI": Case(langchain_agent),
    "openai SDK chat": Case(sdk_chat_agent),
    "openai SDK responses": Case(sdk_responses_agent),
    "anthropic SDK messages": Case(sdk_messages_agent),
}


def chain_ending(calls: list[dict[str, Any]], last: int) -> list[int]:
    """The indices of the calls on the chain that ends at ``last``, root first."""
    index_of = {call["call_id"]: i for i, call in enumerate(calls)}
    chain = [last]
    while (parent := calls[chain[-1]]["parent_call_id"]) is not None:
        chain.append(index_of[parent])
    return chain[::-1]
