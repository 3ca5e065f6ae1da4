"""HTTP shapes every server of the runtime shares: a request error naming its field, and
OpenAI's error body (each API's own error reply is its protocol's, ``pipeline.api.protocols``).

The worker, the gateway and the route gate all answer in these shapes, so they live
below all three.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


class InvalidRequest(ValueError):
    """A request field is invalid; ``param`` is its dotted path (OpenAI's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


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


def error_body(
    message: str, *, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
