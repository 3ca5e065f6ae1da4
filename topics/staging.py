"""Build a complete, digested staged row from a call's delta.

The worker's completion hook and every test that needs a valid row use this one
module, so the digest rules live in exactly one place. It runs on the engine's
completion path, so it works on arrays end to end: ``build_row`` returns a
``StagedRow`` (plain arrays, no pydantic, no Python lists) that the data plane encodes
as it is; ``StagedRow.record`` gives the pydantic ``StagedCall`` off the hot path.
``build_delta`` guarantees the vectors' invariants, and the scalar fields are checked
here directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from topics import canonical, digest
from topics.canonical import IdsLike
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    IDENT_PATTERN,
    ROW_SCHEMA_VERSION,
    Mode,
    StagedCall,
    assemble,
    check_weight_spans,
    staging_key,
)

_IDENT = re.compile(IDENT_PATTERN)
_NO_EXTRAS_DIGEST = digest.extras_digest(None)


@dataclass(slots=True)
class StagedRow:
    """A staged row as the capture path builds it: the vectors stay numpy arrays.

    Same fields and digest as ``StagedCall``; the vectors are the delta's ids (int64),
    mask and logprobs (float32, as stored and as the digest encodes).
    """

    rollout_id: str
    call_id: str
    parent_call_id: str | None
    mode: Mode
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    token_ids: npt.NDArray[np.int64]
    token_mask: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32]
    extras: dict[str, Any] | None
    extras_digest: str
    chain_hash: str
    cumulative_hash: str
    digest: str = ""
    schema_version: int = ROW_SCHEMA_VERSION

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.call_id)

    def record(self) -> StagedCall:
        """The pydantic row (lists), built without re-validation: the arrays were checked."""
        return assemble(
            StagedCall,
            {
                "schema_version": self.schema_version,
                "rollout_id": self.rollout_id,
                "call_id": self.call_id,
                "parent_call_id": self.parent_call_id,
                "mode": self.mode,
                "prev_len": self.prev_len,
                "delta_len": self.delta_len,
                "cum_len": self.cum_len,
                "weight_version": self.weight_version,
                "token_ids_delta": self.token_ids.tolist(),
                "token_mask_delta": self.token_mask.tolist(),
                "logprobs_delta": self.logprobs.tolist(),
                "extras": self.extras,
                "extras_digest": self.extras_digest,
                "chain_hash": self.chain_hash,
                "cumulative_hash": self.cumulative_hash,
                "digest": self.digest,
            },
        )


CallRow = StagedCall | StagedRow
"""What a data plane stores as a call's row: the pydantic record or the capture path's arrays."""


def row_vectors(
    row: CallRow,
) -> tuple[
    npt.NDArray[np.int64] | list[int],
    npt.NDArray[np.float32] | list[float],
    npt.NDArray[np.float32] | list[float],
]:
    """A row's ids, mask and logprobs, as arrays (``StagedRow``) or lists (``StagedCall``)."""
    if isinstance(row, StagedRow):
        return row.token_ids, row.token_mask, row.logprobs
    return row.token_ids_delta, row.token_mask_delta, row.logprobs_delta


def as_record(row: CallRow) -> StagedCall:
    return row.record() if isinstance(row, StagedRow) else row


def build_row(
    *,
    rollout_id: str,
    call_id: str,
    parent_call_id: str | None,
    parent_chain_hash: str | None,
    prefix_ids: IdsLike,
    delta: digest.Delta,
    weight_version: int,
    extras: dict[str, Any] | None = None,
) -> StagedRow:
    """The row of one call; ``prefix_ids`` are the parent's cumulative ids (empty for a root)."""
    for field, value in (
        ("rollout_id", rollout_id),
        ("call_id", call_id),
        ("parent_call_id", parent_call_id),
    ):
        if value is not None and not _IDENT.match(value):
            raise ValueError(f"{field}: {value!r} does not match {IDENT_PATTERN}")
    if (parent_call_id is None) != (parent_chain_hash is None) or (parent_call_id is None) != (
        len(prefix_ids) == 0
    ):
        raise ValueError("parent_call_id: a root has no parent, chain hash or prefix; a child has all three")
    if type(weight_version) is not int or weight_version < 0:
        raise ValueError(f"weight_version: must be an int >= 0, got {weight_version!r}")
    if extras is not None and EXTRAS_WEIGHT_SPANS in extras:
        check_weight_spans(extras[EXTRAS_WEIGHT_SPANS], delta.gen_len)
    prev_len = len(prefix_ids)
    delta_len = int(delta.token_ids.size)
    delta_be = delta.token_ids.astype(">u8")  # encoded once for all three hashes
    row = StagedRow(
        rollout_id=rollout_id,
        call_id=call_id,
        parent_call_id=parent_call_id,
        mode="text" if parent_call_id is None else "token_in",
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=prev_len + delta_len,
        weight_version=weight_version,
        token_ids=delta.token_ids,
        token_mask=delta.token_mask,
        logprobs=delta.logprobs,
        extras=extras,
        extras_digest=_NO_EXTRAS_DIGEST if extras is None else digest.extras_digest(extras),
        chain_hash=digest.chain_hash(parent_chain_hash, delta_be),
        cumulative_hash=digest.cumulative_hash_of_parts(
            canonical.ids_array(prefix_ids, "prefix_ids"), delta_be
        ),
    )
    # build_delta is the only maker of a Delta: its mask and logprobs are finite float32.
    row.digest = digest.digest_of_canonical(
        row, delta_be, delta.token_mask.astype(">f4"), delta.logprobs.astype(">f4")
    )
    return row


def staging_row(**fields: Any) -> StagedCall:
    """``build_row`` as the pydantic ``StagedCall`` (tests, tools and benchmarks that want records)."""
    return build_row(**fields).record()
