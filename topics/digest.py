"""Digests of DESIGN §4.3: extras digest, chain hash, cumulative hash, call digest.

The byte layout is NeMo Gym's external-staging capture (schema 3, digest version 2,
extras digest version 1) so that rows verify across both systems. All hashes are
SHA-256, lowercase hex, each domain-separated by its own prefix.
"""

from __future__ import annotations

import hashlib
import struct
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
_COUNTS = struct.Struct(">QQQQ")
"""prev_len, delta_len, cum_len and weight_version, each a big-endian u64."""
_BLOB_HEADER = struct.Struct(">QQ")
"""A vector's blob length (its count header included), then its count."""
_FLOAT32_MAX = float(np.finfo(np.float32).max)


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
    return chain_hash_of_canonical(parent_chain_hash, canonical.ids_array(token_ids_delta, "token_ids_delta"))


def chain_hash_of_canonical(parent_chain_hash: str | None, token_ids_delta: npt.NDArray[np.uint64]) -> str:
    """``chain_hash`` of a delta already in canonical form (big-endian u64)."""
    link = b"\x00" if parent_chain_hash is None else b"\x01" + bytes.fromhex(parent_chain_hash)
    digest = hashlib.sha256(CHAIN_DOMAIN + link + canonical.u64(token_ids_delta.size))
    digest.update(token_ids_delta.data)
    return digest.hexdigest()


def cumulative_hash(token_ids: IdsLike) -> str:
    """Hash of every token id of the conversation through this call."""
    return cumulative_hash_of_parts(canonical.ids_array(token_ids, "token_ids"))


def cumulative_hash_of_parts(*parts: npt.NDArray[np.uint64]) -> str:
    """``cumulative_hash`` of the parts' ids one after the other, each already a big-endian
    u64 array (``canonical.ids_array``): a child hashes its parent's ids and its delta
    without joining them into one array first."""
    digest = hashlib.sha256(PREFIX_DOMAIN + canonical.u64(sum(part.size for part in parts)))
    for part in parts:
        digest.update(part.data)
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
    token_ids: npt.NDArray[np.integer[Any]],
    token_mask: npt.NDArray[np.floating[Any]],
    logprobs: npt.NDArray[np.floating[Any]],
) -> str:
    """The call digest from a row's scalar fields and its vectors as arrays (no list round trip)."""
    ids_body = canonical.ids_array(token_ids, "token_ids_delta")
    _, mask_body = canonical.f32s_parts(token_mask, "token_mask_delta")
    _, logprobs_body = canonical.f32s_parts(logprobs, "logprobs_delta")
    return digest_of_canonical(row, ids_body, mask_body, logprobs_body)


def digest_of_canonical(
    row: RowIdentity,
    token_ids: npt.NDArray[np.uint64],
    token_mask: npt.NDArray[np.float32],
    logprobs: npt.NDArray[np.float32],
) -> str:
    """The call digest from vectors already in canonical form: big-endian u64 ids and
    big-endian float32 (``>f4``), finite. The capture path builds them that way and so
    skips ``digest_of_row``'s conversions and checks."""
    digest = hashlib.sha256(
        b"".join(
            (
                CALL_DOMAIN,
                bytes([row.schema_version, DIGEST_VERSION, EXTRAS_DIGEST_VERSION]),
                canonical.text(row.rollout_id),
                canonical.text(row.call_id),
                canonical.opt_text(row.parent_call_id),
                canonical.text(row.mode),
                _COUNTS.pack(row.prev_len, row.delta_len, row.cum_len, row.weight_version),
            )
        )
    )
    for body in (token_ids, token_mask, logprobs):
        # Each vector is a blob: its byte length, then its canonical bytes (count, values).
        digest.update(_BLOB_HEADER.pack(8 + body.nbytes, body.size))
        digest.update(body.data)
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
    """The part of a call's token row that is new relative to its parent, as arrays.

    Mask and logprobs are float32: exactly the values the data plane stores and the
    digest encodes, so nothing downstream rounds again.
    """

    token_ids: npt.NDArray[np.int64]
    token_mask: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32]
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
    prompt = _ids64(prompt_ids, "prompt_ids")
    generated = _ids64(generated_ids, "generated_ids")
    if prompt.size < prev_len:
        raise InvalidDelta("prompt_ids", f"has {prompt.size} ids, fewer than prev_len {prev_len}")
    if generated.size == 0:
        raise InvalidDelta("generated_ids", "empty generation")
    logprobs = np.asarray(generated_logprobs, dtype=np.float64)
    if logprobs.ndim != 1 or logprobs.size != generated.size:
        raise InvalidDelta(
            "generated_logprobs", f"has {logprobs.size} values for {generated.size} generated ids"
        )
    # Rows store logprobs as float32 and the digest encodes float32, so round here once:
    # the record then equals what the data plane returns. The bound refuses NaN and Inf
    # too (they compare false), and leaves the rounding nothing to overflow.
    if not (np.abs(logprobs) <= _FLOAT32_MAX).all():
        raise InvalidDelta("generated_logprobs", "must be finite in float32 (no NaN, Inf or |x| > 3.4e38)")
    rounded = logprobs.astype(np.float32)
    carry = prompt.size - prev_len
    delta = np.empty(carry + generated.size, dtype=np.int64)
    delta[:carry] = prompt[prev_len:]
    delta[carry:] = generated
    mask = np.zeros(delta.size, dtype=np.float32)
    mask[carry:] = 1.0
    values = np.zeros(delta.size, dtype=np.float32)
    values[carry:] = rounded
    return Delta(delta, mask, values, carry)


def _ids64(values: IdsLike, field: str) -> npt.NDArray[np.int64]:
    """Token ids as native int64 (ids are below 2**63); lists are checked element by element in C."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        if values.size and int(values.min()) < 0:
            raise InvalidDelta(field, "token ids must be non-negative")
        return values.astype(np.int64, copy=False)
    try:
        ids = canonical.ids_array(values, field)
    except canonical.EncodingError as exc:
        raise InvalidDelta(field, exc.reason) from None
    if ids.size and int(ids.max()) >= 2**63:
        raise InvalidDelta(field, "token ids must be below 2**63")
    return ids.astype(np.int64)


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
    "cumulative_hash_of_parts",
    "digest_of_body",
    "digest_of_canonical",
    "digest_of_row",
    "extras_digest",
]
