"""The generation routes: vLLM's handlers, with capture opened before and coords attached after.

Per request: parse the JSON body, take ``ng_capture`` out of it, refuse unknown or
unhonoured options and non-text content (``pipeline.worker.options``), validate the
body with vLLM's own request model, open the capture scope (prefix resolved before the
engine sees anything), run vLLM's handler with the scope current, then attach each
choice's commit coords to the reply or to the stream's final events
(``pipeline.worker.replies``). Errors come back in the route's API shape: OpenAI's for
Chat, Completions and Responses, Anthropic's for Messages.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.exceptions import VLLMClientError

from pipeline.api.errors import InvalidRequest, invalid_request
from pipeline.api.protocols import PROTOCOLS, Protocol
from pipeline.auth.audit import Audit
from pipeline.auth.credentials import Role
from pipeline.auth.gate import principal_of
from pipeline.worker.options import COMMON, RESPONSES, Refusal, check_content, check_options, field_names
from pipeline.worker.protocol import capture_admissions
from pipeline.worker.replies import attach_coords, stream_with_coords
from pipeline.worker.serving import Serving
from stages.capture.vllm.renderer import CaptureRefused
from stages.capture.vllm.scope import CURRENT_SCOPE, CaptureScope
from stages.capture.vllm.worker import VllmWorker
from topics.failures import WorkerFailure
from topics.wire import CAPTURE_FIELD

Handler = Callable[[Any, Request], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class GenerationRoute:
    """One protocol served by vLLM: its request model and handler, what it refuses."""

    protocol: Protocol
    request_model: type[BaseModel]
    handler: Handler
    refusals: Mapping[str, Refusal]

    @property
    def path(self) -> str:
        return self.protocol.path

    @property
    def known_fields(self) -> frozenset[str]:
        return field_names(self.request_model)


def generation_routes(serving: Serving) -> list[GenerationRoute]:
    return [
        GenerationRoute(
            PROTOCOLS["chat"], ChatCompletionRequest, serving.chat.create_chat_completion, COMMON
        ),
        GenerationRoute(
            PROTOCOLS["completions"], CompletionRequest, serving.completion.create_completion, COMMON
        ),
        GenerationRoute(
            PROTOCOLS["responses"],
            ResponsesRequest,
            serving.responses.create_responses,
            {**COMMON, **RESPONSES},
        ),
        GenerationRoute(
            PROTOCOLS["messages"], AnthropicMessagesRequest, serving.messages.create_messages, COMMON
        ),
    ]


def add_generation_routes(
    app: FastAPI,
    worker: VllmWorker,
    serving: Serving,
    *,
    audit: Audit,
    capture_roles: frozenset[Role] | None,
) -> None:
    """``capture_roles``: who may send ``ng_capture`` (None: anyone, no credentials set)."""
    for route in generation_routes(serving):
        app.post(route.path)(_endpoint(route, worker, audit, capture_roles))


def _endpoint(
    route: GenerationRoute, worker: VllmWorker, audit: Audit, capture_roles: frozenset[Role] | None
) -> Callable[[Request], Awaitable[Response]]:
    known = route.known_fields

    async def serve(request: Request) -> Response:
        worker.requests.requests += 1
        body: dict[str, Any] = {}
        raw_capture: Any = None
        try:
            body = _json_object(await request.body())
            raw_capture = body.pop(CAPTURE_FIELD, None)
            principal = principal_of(request)
            if raw_capture is not None and capture_roles is not None and principal.role not in capture_roles:
                # before anything is reported: nobody with the right admitted this capture
                audit.refused("wrong_role", str(principal), request.method, request.url.path)
                message = f"{CAPTURE_FIELD}: capture needs the service credential"
                return route.protocol.error(403, message, param=CAPTURE_FIELD)
            check_options(body, known, route.refusals, captured=raw_capture is not None)
            check_content(body, route.protocol)
            parsed = _validated(route.request_model, body)
            admissions = capture_admissions(raw_capture, int(getattr(parsed, "n", None) or 1))
        except InvalidRequest as exc:
            worker.requests.rejected_requests += 1
            _report_refused(worker, raw_capture, body)
            return route.protocol.error(400, exc.message, param=exc.param)
        if not admissions:
            return await _reply(route, await _handled(route, parsed, request), None, worker)
        scope = await worker.open_scope(admissions, response_id=f"req-{uuid.uuid4().hex}")
        token = CURRENT_SCOPE.set(scope)
        try:
            result = await _handled(route, parsed, request)
        except CaptureRefused as exc:
            scope.abandon(WorkerFailure.NOT_SERVED, worker.weight_version)
            worker.requests.rejected_requests += 1
            return route.protocol.error(400, f"{CAPTURE_FIELD}: {exc}", param=CAPTURE_FIELD)
        except BaseException:
            scope.abandon(WorkerFailure.NOT_SERVED, worker.weight_version)
            raise
        finally:
            CURRENT_SCOPE.reset(token)
        return await _reply(route, result, scope, worker)

    return serve


def _report_refused(worker: VllmWorker, raw_capture: Any, body: dict[str, Any]) -> None:
    """A refused request's valid admissions fail ``not_served`` now: the driver published
    them, and the ledger should not wait out its grace period for calls never served."""
    n = body.get("n")
    try:
        admissions = capture_admissions(raw_capture, n if type(n) is int and n >= 1 else 1)
    except InvalidRequest:
        return  # nothing validly admitted: nothing to report
    for admission in admissions:
        worker.core.refuse(admission, worker.weight_version)


async def _handled(route: GenerationRoute, parsed: BaseModel, request: Request) -> Any:
    """vLLM's handler; an exception it raises becomes its error reply (vLLM's own mapping)."""
    try:
        return await route.handler(parsed, request)
    except CaptureRefused:
        raise
    except Exception as exc:
        return create_error_response(exc)


async def _reply(
    route: GenerationRoute, result: Any, scope: CaptureScope | None, worker: VllmWorker
) -> Response:
    if isinstance(result, ErrorResponse):
        if scope is not None:
            scope.abandon(WorkerFailure.NOT_SERVED, worker.weight_version)
        if result.error.code == 400:
            worker.requests.rejected_requests += 1
        error = result.error
        return route.protocol.error(error.code, error.message, param=error.param, kind=error.type)
    if isinstance(result, BaseModel):
        body = route.protocol.dump(result)
        if scope is not None:
            body = await attach_coords(body, route.protocol, scope)
        return JSONResponse(body)
    events = _sse(result)
    if scope is not None:
        events = stream_with_coords(events, route.protocol, scope, worker.weight_version)
    return StreamingResponse(events, media_type="text/event-stream")


async def _sse(stream: AsyncIterator[Any]) -> AsyncIterator[str]:
    """vLLM's stream as SSE text (its Responses handler yields event objects, the rest text)."""
    async for event in stream:
        if isinstance(event, str):
            yield event
        else:
            kind = getattr(event, "type", "unknown")
            yield f"event: {kind}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(None, f"body: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequest(None, "body: must be a JSON object")
    return body


def _validated(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    except (ValueError, VLLMClientError) as exc:  # vLLM's own validators raise these
        param = getattr(exc, "parameter", None)
        raise InvalidRequest(param, f"{param or 'body'}: {exc}") from None


__all__ = ["GenerationRoute", "add_generation_routes", "generation_routes"]
