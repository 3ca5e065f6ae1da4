"""The HTTP shapes of the worker: OpenAI chat requests in, chat completions out.

Requests are validated here, before anything reaches the worker, so a bad field is a
400 that names it and never a half-captured call. The reply is built from an explicit
allow-list of fields: token ids and logprobs cannot leak into it by accident.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stages.capture.vllm.worker import ChatCall, ServedChat
from topics.records import CaptureAdmission, CommitCoords
from topics.wire import CAPTURE_FIELD, COORDS_FIELD

ModelT = TypeVar("ModelT", bound=BaseModel)


class InvalidRequest(ValueError):
    """A request field is invalid; ``param`` is its dotted path (OpenAI's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class ChatMessage(BaseModel):
    """One message; fields beyond OpenAI's (``reasoning_content``, ...) reach the template as given."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat-completions body this worker serves, plus ``ng_capture`` and ``ignore_eos``.

    Unknown OpenAI options are ignored rather than refused, as most servers do; the
    ones that would change what is returned (``n``, ``stream``) are checked.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False
    ng_capture: Any = None

    def chat_call(self) -> ChatCall:
        if self.n != 1:
            raise InvalidRequest("n", f"n: only n=1 is supported, got {self.n}")
        if self.stream:
            raise InvalidRequest("stream", "stream: streaming replies are not supported")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return ChatCall(
            messages=[_template_message(m) for m in self.messages],
            tools=self.tools,
            max_tokens=self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )

    def admission(self) -> CaptureAdmission | None:
        """The ``ng_capture`` admission, or None when the request is not captured."""
        if self.ng_capture is None:
            return None
        try:
            return CaptureAdmission.model_validate(self.ng_capture)
        except ValidationError as exc:
            raise invalid_request(exc, CAPTURE_FIELD) from None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """Unset fields dropped, but ``content`` always present: templates test it for none."""
    return {"content": None, **message.model_dump(exclude_none=True)}


# A model-level validator names its field first: "Value error, staging_chain: ...".
_FIELD_IN_MESSAGE = re.compile(r"^(?:Value error, )?([a-z_][a-z0-9_]*): ")


def invalid_request(exc: ValidationError, root: str | None = None) -> InvalidRequest:
    """The first error of ``exc`` as a 400 naming its field by its full dotted path."""
    error = exc.errors(include_url=False)[0]
    path = [str(part) for part in error["loc"]]
    message = str(error["msg"])
    if not path:
        match = _FIELD_IN_MESSAGE.match(message)
        if match is not None:
            path = [match.group(1)]
    param = ".".join(([root] if root else []) + path) or None
    return InvalidRequest(param, f"{param or 'body'}: {message}")


def parse_body(model: type[ModelT], body: Any) -> ModelT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None


def chat_completion(
    served: ServedChat, *, model: str, coords: CommitCoords | None, created: int | None = None
) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` object; ids and logprobs are never part of it."""
    message: dict[str, Any] = {"role": "assistant", "content": served.reply.content}
    if served.reply.tool_calls:
        message["tool_calls"] = served.reply.tool_calls
    body: dict[str, Any] = {
        "id": served.response_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": served.finish_reason}],
        "usage": {
            "prompt_tokens": served.prompt_tokens,
            "completion_tokens": served.completion_tokens,
            "total_tokens": served.prompt_tokens + served.completion_tokens,
        },
        "weight_version": served.weight_version,
    }
    if coords is not None:
        body[COORDS_FIELD] = coords.model_dump(mode="json")
    return body


def error_body(
    message: str, *, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_list(names: Sequence[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "owned_by": "tokentrail"} for name in names],
    }


class ReloadWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)


class SetWeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: int = Field(ge=0)
