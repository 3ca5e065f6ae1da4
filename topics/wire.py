"""The names capture adds to the OpenAI-compatible HTTP protocol, and the fields it hides.

A request carries its admission as ``ng_capture``; a reply carries the call's commit
coordinates as ``ng_commit_coords``. Token-carrying fields never reach an agent. Both
sides (the driver's client, the worker and the Megatron adapter) import these from the
contract, so neither depends on the other.
"""

from __future__ import annotations

from typing import Any, Literal

Dialect = Literal["chat", "completions", "responses", "messages"]
"""The generation APIs the worker and the gateway serve: OpenAI's three and Anthropic's Messages."""

CAPTURE_FIELD = "ng_capture"
COORDS_FIELD = "ng_commit_coords"

TOKEN_FIELDS = frozenset(
    {"prompt_token_ids", "token_ids", "logprobs", "generated_token_ids", "prompt_logprobs"}
)
"""Reply fields that carry tokens; the agent must never see them."""


def strip_token_fields(value: Any, hidden: frozenset[str] = TOKEN_FIELDS) -> Any:
    """A reply with every ``hidden`` field (by default the token-carrying ones) removed, at any depth."""
    if isinstance(value, dict):
        return {k: strip_token_fields(v, hidden) for k, v in value.items() if k not in hidden}
    if isinstance(value, list):
        return [strip_token_fields(item, hidden) for item in value]
    return value
