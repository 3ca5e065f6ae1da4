"""One agent call through the gateway: lineage, admission, forwarding, the clean reply.

Per call: place it in its session's tree (``lineage.resolve``), mint the admission(s)
from the parent's commit coordinates (one per choice when ``n`` > 1) and publish them,
forward the request to a worker with ``ng_capture``, and hand the agent the worker's
reply without tokentrail's fields (``replies``), streaming included. The reply the agent
got is normalized too, so the next call that continues it finds its parent. A worker
that fails before replying is benched and the call is retried on another as a new
attempt (same logical id: the ledger collapses the attempts).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.api.protocols import CHAT, MESSAGES, Protocol
from pipeline.api.protocols.turns import MalformedHistory, Turn
from pipeline.gateway.history import History, extended
from pipeline.gateway.leftout import restore_left_out
from pipeline.gateway.lineage import (
    GatewayCall,
    left_out_replies,
    logical_call_id,
    reasoning_rewrite,
    resolve,
)
from pipeline.gateway.replies import hidden_fields, strip_event
from pipeline.gateway.sessions import Session
from pipeline.gateway.upstream import NoWorker, Workers
from stages.client import RolloutClient
from topics.choices import choice_admissions
from topics.records import CaptureAdmission, CommitCoords
from topics.wire import CAPTURE_FIELD, strip_token_fields

log = logging.getLogger(__name__)

OnReply = Callable[[Mapping[str, Any]], None]
RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass(slots=True)
class CallCounters:
    calls: int = 0
    roots: int = 0
    children: int = 0
    retries: int = 0
    worker_failures: int = 0
    template_changes: int = 0
    """Roots whose template variables differ from their session's previous call's."""
    reasoning_rewrites: Counter[str] = field(default_factory=Counter)
    """Children whose parent's reply came back with its reasoning rewritten, by kind."""


def _template_changed(session: Session, history: History) -> bool:
    """The previous call of the session was rendered with other ``chat_template_kwargs``."""
    previous = next((c for c in reversed(session.calls) if c.template_start is not None), None)
    return previous is not None and history.start is not None and previous.template_start != history.start


class Forwarder:
    """Serves agent calls for every session on the given workers."""

    def __init__(self, client: RolloutClient, workers: Workers, http: httpx.AsyncClient) -> None:
        self.client = client
        self.workers = workers
        self.http = http
        self.counters = CallCounters()

    async def call(
        self,
        session: Session,
        protocol: Protocol,
        body: dict[str, Any],
        history: History,
        *,
        on_reply: OnReply | None = None,
    ) -> Response:
        """Serve one agent call; ``on_reply`` sees the worker's whole reply (or final response) once."""
        n = protocol.choice_count(body)
        resolution = resolve(session.calls, history, session.by_id)
        logical = resolution.retry_of.logical_call_id if resolution.retry_of else logical_call_id(history)
        left_out = left_out_replies(resolution.parent, history, session.by_id)
        self._count(resolution.parent, resolution.retry_of is not None)
        if resolution.parent is not None and resolution.retry_of is None:
            self._count_rewrite(resolution.parent, history, left_out)
        if resolution.parent is None and resolution.retry_of is None and _template_changed(session, history):
            self.counters.template_changes += 1
        hidden = hidden_fields(bool(body.get("logprobs") or body.get("top_logprobs")))
        tried: list[str] = []
        session.in_flight += 1
        try:
            while True:
                try:
                    url = self.workers.choose(session.worker if resolution.parent else None, avoid=tried)
                except NoWorker as exc:
                    return protocol.error(503, str(exc))
                calls = await self._admit(session, resolution.parent, logical, history, n)
                request = {
                    **restore_left_out(protocol, body, history, left_out),
                    CAPTURE_FIELD: calls[0][1].model_dump(mode="json"),
                }
                attempt = _Attempt(
                    session, protocol, url, f"{url}{protocol.path}", request, calls, hidden, history, on_reply
                )
                try:
                    return await (self._stream(attempt) if body.get("stream") else self._whole(attempt))
                except (*RETRYABLE, _WorkerFailed) as exc:
                    log.warning("worker %s failed a call of %s: %s; retrying", url, session.rollout_id, exc)
                    self.workers.failed(url)
                    self.counters.worker_failures += 1
                    tried.append(url)
        finally:
            session.in_flight -= 1

    async def models(self, *, anthropic: bool) -> Response:
        """The workers' served models, as an SDK asks before its first call: OpenAI's list, or
        Anthropic's when the request says it speaks it. Only names and limits go out (vLLM's
        entries also carry the model's path on the worker's disk)."""
        asking = MESSAGES if anthropic else CHAT
        try:
            url = self.workers.choose()
        except NoWorker as exc:
            return asking.error(503, str(exc))
        try:
            response = await self.http.get(f"{url}/v1/models")
        except httpx.HTTPError as exc:
            self.workers.failed(url)
            return asking.error(503, f"the worker is unreachable: {exc!r}")
        if response.status_code != 200:
            return CHAT.error(502, f"the worker answered {response.status_code} for its models")
        served = orjson.loads(response.content)["data"]
        if anthropic:
            listed = [
                {
                    "type": "model",
                    "id": m["id"],
                    "display_name": m["id"],
                    "created_at": _rfc3339(m["created"]),
                }
                for m in served
            ]
            first, last = (listed[0]["id"], listed[-1]["id"]) if listed else (None, None)
            return JSONResponse({"data": listed, "has_more": False, "first_id": first, "last_id": last})
        kept = ("id", "object", "created", "owned_by", "max_model_len")
        return JSONResponse({"object": "list", "data": [{k: m[k] for k in kept if k in m} for m in served]})

    def _count(self, parent: GatewayCall | None, retry: bool) -> None:
        self.counters.calls += 1
        if retry:
            self.counters.retries += 1
        elif parent is None:
            self.counters.roots += 1
        else:
            self.counters.children += 1

    def _count_rewrite(self, parent: GatewayCall, history: History, left_out: tuple[int, ...]) -> None:
        """How the agent sent the parent's reply back (the turn before the new ones)."""
        if parent.request_length in left_out:
            self.counters.reasoning_rewrites["reply_left_out"] += 1
            return
        at = (parent.extended_length or 0) - 1
        if 0 <= at < len(history.reasoning):
            kind = reasoning_rewrite(parent.reply_reasoning, history.reasoning[at])
            if kind is not None:
                self.counters.reasoning_rewrites[kind] += 1

    async def _admit(
        self, session: Session, parent: GatewayCall | None, logical: str, history: History, n: int
    ) -> list[tuple[GatewayCall, CaptureAdmission]]:
        """Admit (and publish) one call per choice; they join the session at once."""
        base = self.client.admit(
            session.rollout_id,
            parent.coords if parent is not None else None,
            group_id=session.group_id,
            logical_call_id=logical,
            history=session.history,
        )
        admissions = choice_admissions(base, n)
        if n > 1:  # choices are siblings, not attempts: each its own logical call
            admissions = [
                a.model_copy(update={"logical_call_id": f"{logical}.{i}"}) for i, a in enumerate(admissions)
            ]
        await self.client.sink.publish(admissions)
        calls = []
        for admission in admissions:
            call = GatewayCall(
                call_id=admission.call_id,
                logical_call_id=admission.logical_call_id or logical,
                parent_call_id=admission.parent_call_id,
                kind=history.kind,
                request_length=history.length,
                request_digest=history.digest,
                template_start=history.start,
            )
            session.add(call)
            calls.append((call, admission))
        return calls

    async def _whole(self, attempt: _Attempt) -> Response:
        async with self.workers.serving(attempt.url, attempt.session.rollout_id) as use:
            response = await self.http.post(
                attempt.target, content=orjson.dumps(attempt.request), headers=_JSON
            )
        if response.status_code >= 500:
            raise _WorkerFailed(f"HTTP {response.status_code}")
        reply = orjson.loads(response.content)
        if response.status_code != 200:
            return JSONResponse(strip_token_fields(reply, attempt.hidden), status_code=response.status_code)
        try:
            turns = attempt.protocol.reply_turns(reply)
        except MalformedHistory:  # a reply it cannot normalize: delivered, but nothing continues it
            turns = {}
        attempt.answered(attempt.protocol.coords_in(reply), turns, reply)
        use.generated(generated_tokens(reply))
        return JSONResponse(strip_token_fields(reply, attempt.hidden))

    async def _stream(self, attempt: _Attempt) -> Response:
        slot = AsyncExitStack()  # held from the request until the stream ends
        use = await slot.enter_async_context(self.workers.serving(attempt.url, attempt.session.rollout_id))
        try:
            upstream = await self.http.send(
                self.http.build_request(
                    "POST", attempt.target, content=orjson.dumps(attempt.request), headers=_JSON
                ),
                stream=True,
            )
        except BaseException:
            await slot.aclose()
            raise
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            await slot.aclose()
            if upstream.status_code >= 500:
                raise _WorkerFailed(f"HTTP {upstream.status_code}")
            return JSONResponse(
                strip_token_fields(orjson.loads(content), attempt.hidden), status_code=upstream.status_code
            )

        async def close() -> None:  # idempotent: after the stream, and when it is collected
            await upstream.aclose()
            await slot.aclose()

        async def events() -> AsyncIterator[str]:
            reply = attempt.protocol.streamed_reply()
            coords: dict[int, CommitCoords] = {}
            attempt.session.in_flight += 1
            try:
                steps = 0
                async for event in _sse_events(upstream):
                    steps += 1
                    reply.feed(event)
                    clean, found = strip_event(attempt.protocol, event, attempt.hidden)
                    coords.update(found)
                    yield clean
                attempt.answered(coords, reply.turns(), reply.reply())
                use.generated(steps)  # about one event per engine step: its token count
            finally:
                attempt.session.in_flight -= 1
                await close()

        stream = events()
        # A client that leaves before the first byte leaves the generator unstarted, and its
        # ``finally`` never runs: the slot and the connection are freed when it is collected.
        weakref.finalize(stream, _later, close)
        return StreamingResponse(stream, media_type="text/event-stream")


@dataclass(slots=True)
class _Attempt:
    """One try of a call on one worker, and what its reply must update."""

    session: Session
    protocol: Protocol
    url: str
    target: str
    request: dict[str, Any]
    calls: list[tuple[GatewayCall, CaptureAdmission]]
    hidden: frozenset[str]
    history: History
    on_reply: OnReply | None

    def answered(
        self, coords: Mapping[int, CommitCoords], turns: Mapping[int, Turn], reply: Mapping[str, Any] | None
    ) -> None:
        """Record each choice's reply and coords: the next call that continues it finds it."""
        for index, (call, _) in enumerate(self.calls):
            turn = turns.get(index)
            if turn is None:
                continue
            length, digest = extended(self.history, turn)
            call.answered(length, digest, coords.get(index), self.url, turn.reasoning, turn.empty)
        self.session.worker = self.url
        self.session.usage.tokens += sum(c.cum_len for c in coords.values())
        if self.on_reply is not None and reply is not None:
            self.on_reply(reply)


def generated_tokens(reply: Mapping[str, Any]) -> int | None:
    """The tokens a reply says it generated (OpenAI's ``completion_tokens``, Anthropic's and
    the Responses API's ``output_tokens``); None when it does not say."""
    usage = reply.get("usage")
    if not isinstance(usage, Mapping):
        return None
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


_CLOSING: set[asyncio.Task[None]] = set()
"""Clean-ups scheduled from a finalizer, held until done (the loop keeps only weak references)."""


def _later(close: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``close`` on the running loop (a finalizer cannot await); nothing when it is gone."""
    try:
        task = asyncio.get_running_loop().create_task(close())
    except RuntimeError:  # the loop has stopped: the process is ending and frees it all
        return
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


class _WorkerFailed(RuntimeError):
    """The worker answered with a server error before any of the reply reached the agent."""


_JSON = {"content-type": "application/json"}


async def _sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The upstream stream, one SSE message (ending in a blank line) at a time."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            yield event + "\n\n"
    if buffer.strip():
        yield buffer


def _rfc3339(epoch_s: int) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = ["CallCounters", "Forwarder"]
