"""Digests of DESIGN §4.3: extras digest, chain hash, cumulative hash, call digest.

The byte layout is NeMo Gym's external-staging capture (schema 3, digest version 2,
extras digest version 1) so that rows verify across both systems. All hashes are
SHA-256, lowercase hex, each domain-separated by its own prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
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
    return digest_of_row(
        body,
        np.asarray(body.token_ids_delta, dtype=np.int64),
        np.asarray(body.token_mask_delta, dtype=np.float64),
        np.asarray(body.logprobs_delta, dtype=np.float64),
    )


class RowIdentity(Protocol):
    """The scalar fields of a row the call digest covers."""

    @property
    def schema_version(self) -> int: ...
    @property
    def rollout_id(self) -> str: ...
    @property
    def call_id(self) -> str: ...
    @property
    def parent_call_id(self) -> str | None: ...
    @property
    def mode(self) -> str: ...
    @property
    def prev_len(self) -> int: ...
    @property
    def delta_len(self) -> int: ...
    @property
    def cum_len(self) -> int: ...
    @property
    def weight_version(self) -> int: ...
    @property
    def extras_digest(self) -> str: ...
    @property
    def chain_hash(self) -> str: ...
    @property
    def cumulative_hash(self) -> str: ...


def digest_of_row(
    row: RowIdentity,
    token_ids: npt.NDArray[np.int64],
    token_mask: npt.NDArray[np.float64],
    logprobs: npt.NDArray[np.float64],
) -> str:
    """The call digest from a row's scalar fields and its vectors as arrays (no list round trip)."""
    digest = hashlib.sha256(
        b"".join(
            (
                CALL_DOMAIN,
                bytes([row.schema_version, DIGEST_VERSION, EXTRAS_DIGEST_VERSION]),
                canonical.text(row.rollout_id),
                canonical.text(row.call_id),
                canonical.opt_text(row.parent_call_id),
                canonical.text(row.mode),
                canonical.u64(row.prev_len),
                canonical.u64(row.delta_len),
                canonical.u64(row.cum_len),
                canonical.u64(row.weight_version),
            )
        )
    )
    header, body = canonical.ids_parts(token_ids, "token_ids_delta")
    digest.update(canonical.u64(len(header) + body.nbytes) + header)
    digest.update(body.data)
    for values, field in ((token_mask, "token_mask_delta"), (logprobs, "logprobs_delta")):
        digest.update(canonical.blob(canonical.f32s(values, field)))
    digest.update(
        bytes.fromhex(row.extras_digest)
        + b"\x01"
        + bytes.fromhex(row.chain_hash)
        + b"\x01"
        + bytes.fromhex(row.cumulative_hash)
    )
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Delta:
    """The part of a call's token row that is new relative to its parent, as arrays."""

    token_ids: npt.NDArray[np.int64]
    token_mask: npt.NDArray[np.float64]
    logprobs: npt.NDArray[np.float64]
    carry_len: int

    @property
    def gen_len(self) -> int:
        return int(self.token_ids.size) - self.carry_len


def build_delta(
    prompt_ids: IdsLike, generated_ids: IdsLike, generated_logprobs: FloatsLike, prev_len: int
) -> Delta:
    """The delta row: prompt tokens past ``prev_len`` (mask 0, logprob 0.0), then generated ones.

    Its invariants (mask zeros then ones, at least one generated token, zero logprobs
    under mask 0, finite values, non-negative ids) hold by construction.
    """
    if prev_len < 0:
        raise InvalidDelta("prev_len", f"must be >= 0, got {prev_len}")
    prompt = canonical.ids_array(prompt_ids, "prompt_ids")
    generated = canonical.ids_array(generated_ids, "generated_ids")
    if prompt.size < prev_len:
        raise InvalidDelta("prompt_ids", f"has {prompt.size} ids, fewer than prev_len {prev_len}")
    if generated.size == 0:
        raise InvalidDelta("generated_ids", "empty generation")
    if int(max(prompt.max(initial=0), generated.max())) >= 2**63:
        raise InvalidDelta("generated_ids", "token ids must be below 2**63")
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
    token_ids = np.concatenate((prompt[prev_len:], generated)).astype(np.int64)
    mask = np.concatenate((np.zeros(carry), np.ones(generated.size)))
    return Delta(token_ids, mask, np.concatenate((np.zeros(carry), logprobs)), carry)


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
    "digest_of_row",
    "extras_digest",
]
