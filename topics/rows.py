"""Build a complete, digested ``StagedCall`` row from a call's delta.

The worker's completion hook and every test that needs a valid row use this one
function, so the digest rules live in exactly one place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from topics import digest
from topics.canonical import IdsLike
from topics.records import StagedCall, StagedCallBody


def stage_row(
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
    prev_len = len(prefix_ids)
    body = StagedCallBody(
        rollout_id=rollout_id,
        call_id=call_id,
        parent_call_id=parent_call_id,
        mode="text" if parent_call_id is None else "token_in",
        prev_len=prev_len,
        delta_len=len(delta.token_ids),
        cum_len=prev_len + len(delta.token_ids),
        weight_version=weight_version,
        token_ids_delta=delta.token_ids,
        token_mask_delta=delta.token_mask,
        logprobs_delta=delta.logprobs,
        extras=extras,
        extras_digest=digest.extras_digest(extras),
        chain_hash=digest.chain_hash(parent_chain_hash, delta.token_ids),
        cumulative_hash=digest.cumulative_hash(_concat(prefix_ids, delta.token_ids)),
    )
    return StagedCall.model_construct(**dict(body), digest=digest.digest_of_body(body))


def _concat(prefix_ids: IdsLike, delta_ids: list[int]) -> IdsLike:
    if len(prefix_ids) == 0:
        return delta_ids
    if isinstance(prefix_ids, np.ndarray):
        return np.concatenate((prefix_ids.astype(np.int64), np.asarray(delta_ids, dtype=np.int64)))
    return [*prefix_ids, *delta_ids]
