"""Digests of DESIGN §4.3: extras digest, chain hash, cumulative hash, call digest.

The byte layout is NeMo Gym's external-staging capture (schema 3, digest version 2,
extras digest version 1) so that rows verify across both systems. All hashes are
SHA-256, lowercase hex, each domain-separated by its own prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from topics import canonical
from topics.canonical import FloatsLike, IdsLike
from topics.records import DIGEST_VERSION, EXTRAS_DIGEST_VERSION, SCHEMA_VERSION, StagedCallBody

EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"
PREFIX_DOMAIN = b"nemo-gym-staging-prefix-v2"
CALL_DOMAIN = b"nemo-gym-staging-call-v2"


class InvalidDelta(ValueError):
    """A delta that breaks DESIGN §4.2; ``field`` names the offending input."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def extras_digest(extras: Any) -> str:
    return hashlib.sha256(
        EXTRAS_DOMAIN + bytes([EXTRAS_DIGEST_VERSION]) + canonical.extras(extras)
    ).hexdigest()


def chain_hash(parent_chain_hash: str | None, token_ids_delta: IdsLike) -> str:
    """Hash of a call's delta chained onto its parent's chain hash (None for a root)."""
    link = b"\x00" if parent_chain_hash is None else b"\x01" + bytes.fromhex(parent_chain_hash)
    header, body = canonical.ids_parts(token_ids_delta, "token_ids_delta")
    digest = hashlib.sha256(CHAIN_DOMAIN + link + header)
    digest.update(body.data)
    return digest.hexdigest()


def cumulative_hash(token_ids: IdsLike) -> str:
    """Hash of every token id of the conversation through this call."""
    header, body = canonical.ids_parts(token_ids, "token_ids")
    digest = hashlib.sha256(PREFIX_DOMAIN + header)
    digest.update(body.data)
    return digest.hexdigest()


def call_digest(fields: Mapping[str, Any]) -> str:
    """Digest of a staged row given its fields (every ``StagedCall`` field except ``digest``).

    The §4.2 rules are checked first; whether the chain and cumulative hashes match the
    ids is the verifier's job, not this function's.
    """
    try:
        body = StagedCallBody.model_validate(dict(fields))
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "fields"
        raise InvalidDelta(location, first["msg"]) from None
    return digest_of_body(body)


def digest_of_body(body: StagedCallBody) -> str:
    """Digest of an already validated row body."""
    payload = b"".join(
        (
            CALL_DOMAIN,
            bytes([body.schema_version, DIGEST_VERSION, EXTRAS_DIGEST_VERSION]),
            canonical.text(body.rollout_id),
            canonical.text(body.call_id),
            canonical.opt_text(body.parent_call_id),
            canonical.text(body.mode),
            canonical.u64(body.prev_len),
            canonical.u64(body.delta_len),
            canonical.u64(body.cum_len),
            canonical.u64(body.weight_version),
            canonical.blob(canonical.ids(body.token_ids_delta, "token_ids_delta")),
            canonical.blob(canonical.f32s(body.token_mask_delta, "token_mask_delta")),
            canonical.blob(canonical.f32s(body.logprobs_delta, "logprobs_delta")),
            bytes.fromhex(body.extras_digest),
            b"\x01",
            bytes.fromhex(body.chain_hash),
            b"\x01",
            bytes.fromhex(body.cumulative_hash),
        )
    )
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True, slots=True)
class Delta:
    """The part of a call's token row that is new relative to its parent."""

    token_ids: list[int]
    token_mask: list[float]
    logprobs: list[float]
    carry_len: int

    @property
    def gen_len(self) -> int:
        return len(self.token_ids) - self.carry_len


def build_delta(
    prompt_ids: IdsLike, generated_ids: IdsLike, generated_logprobs: FloatsLike, prev_len: int
) -> Delta:
    """The delta row: prompt tokens past ``prev_len`` (mask 0, logprob 0.0), then generated ones."""
    if prev_len < 0:
        raise InvalidDelta("prev_len", f"must be >= 0, got {prev_len}")
    prompt = canonical.ids_array(prompt_ids, "prompt_ids")
    generated = canonical.ids_array(generated_ids, "generated_ids")
    if prompt.size < prev_len:
        raise InvalidDelta("prompt_ids", f"has {prompt.size} ids, fewer than prev_len {prev_len}")
    if generated.size == 0:
        raise InvalidDelta("generated_ids", "empty generation")
    logprobs = np.asarray(generated_logprobs, dtype=np.float64)
    if logprobs.ndim != 1 or logprobs.size != generated.size:
        raise InvalidDelta(
            "generated_logprobs", f"has {logprobs.size} values for {generated.size} generated ids"
        )
    if not np.isfinite(logprobs).all():
        raise InvalidDelta("generated_logprobs", "must be finite (no NaN or Inf)")
    # Rows store logprobs as float32 and the digest encodes float32, so round here once:
    # the record then equals what the data plane returns.
    logprobs = logprobs.astype(np.float32).astype(np.float64)
    carry = prompt.size - prev_len
    token_ids = np.concatenate((prompt[prev_len:], generated)).astype(np.int64).tolist()
    mask = [0.0] * carry + [1.0] * generated.size
    return Delta(token_ids, mask, [0.0] * carry + logprobs.tolist(), carry)


def linear_ids(deltas: Sequence[IdsLike]) -> np.ndarray:
    """Concatenate the deltas of a chain into the ids the engine saw."""
    return np.concatenate([canonical.ids_array(d) for d in deltas]) if deltas else np.zeros(0, ">u8")


__all__ = [
    "DIGEST_VERSION",
    "EXTRAS_DIGEST_VERSION",
    "SCHEMA_VERSION",
    "Delta",
    "InvalidDelta",
    "build_delta",
    "call_digest",
    "chain_hash",
    "cumulative_hash",
    "digest_of_body",
    "extras_digest",
    "linear_ids",
]
