"""Build a complete, digested ``StagedCall`` row from a call's delta.

The worker's completion hook and every test that needs a valid row use this one
function, so the digest rules live in exactly one place. It runs on the engine's
completion path, so it works on arrays and does not re-validate the token vectors
with pydantic: ``build_delta`` guarantees their invariants, and the scalar fields
are checked here directly.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import numpy.typing as npt

from topics import canonical, digest
from topics.canonical import IdsLike
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    IDENT_PATTERN,
    ROW_SCHEMA_VERSION,
    StagedCall,
    check_weight_spans,
)

_IDENT = re.compile(IDENT_PATTERN)


def staging_row(
    *,
    rollout_id: str,
    call_id: str,
    parent_call_id: str | None,
    parent_chain_hash: str | None,
    prefix_ids: IdsLike,
    delta: digest.Delta,
    weight_version: int,
    extras: dict[str, Any] | None = None,
) -> StagedCall:
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
    fields: dict[str, Any] = {
        "schema_version": ROW_SCHEMA_VERSION,
        "rollout_id": rollout_id,
        "call_id": call_id,
        "parent_call_id": parent_call_id,
        "mode": "text" if parent_call_id is None else "token_in",
        "prev_len": prev_len,
        "delta_len": delta_len,
        "cum_len": prev_len + delta_len,
        "weight_version": weight_version,
        "extras": extras,
        "extras_digest": digest.extras_digest(extras),
        "chain_hash": digest.chain_hash(parent_chain_hash, delta.token_ids),
        "cumulative_hash": digest.cumulative_hash(_concat(prefix_ids, delta.token_ids)),
    }
    row = StagedCall.model_construct(
        **fields,
        token_ids_delta=delta.token_ids.tolist(),
        token_mask_delta=delta.token_mask.tolist(),
        logprobs_delta=delta.logprobs.tolist(),
        digest="",
    )
    row_digest = digest.digest_of_row(row, delta.token_ids, delta.token_mask, delta.logprobs)
    return row.model_copy(update={"digest": row_digest})


def _concat(prefix_ids: IdsLike, delta_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    if len(prefix_ids) == 0:
        return delta_ids.astype(np.uint64)
    return np.concatenate((canonical.ids_array(prefix_ids, "prefix_ids"), delta_ids.astype(">u8")))
