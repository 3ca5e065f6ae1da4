"""Commit coordinates of a finished call, computed from arrays inside the engine's hook.

``CaptureCore.complete`` builds and validates the whole ``StagedCall`` row (pydantic
checks every token of the delta), which costs milliseconds for long calls: far too much
for Megatron's completion hook, which runs on model-parallel rank 0 inside the engine
step. The driver, though, needs only the coordinates: lengths, staging keys and the
four hashes. This module computes exactly those from numpy arrays, with the same
encodings and digest function the row uses (``topics.digest``), so the coords equal
what ``CaptureCore.complete`` later returns for the same inputs on the capture loop.
The stager checks that equality for every call and counts any difference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.capture.core import PreparedCall
from stages.capture.errors import CaptureFailure
from stages.capture.megatron_payload import FinishedCall
from topics import digest
from topics.canonical import EncodingError
from topics.failures import WorkerFailure
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    CaptureAdmission,
    CommitCoords,
    StagedCallBody,
    check_weight_spans,
    staging_key,
)


def staged_coords(
    prepared: PreparedCall,
    call: FinishedCall,
    *,
    weight_version: int,
    extras: dict[str, Any] | None = None,
) -> CommitCoords:
    """Coords of a call whose row will stage; raises ``CaptureFailure`` like ``complete`` would.

    The prompt must start with the exact prefix (else ``prefix_splice_failed``); the
    delta is the prompt past ``prev_len`` (mask 0, logprob 0.0) then the generation.
    """
    admission = prepared.admission
    prefix = prepared.prefix_ids
    prev_len = admission.prev_len
    prompt = call.prompt_ids
    if prefix.size != prev_len:
        raise CaptureFailure(
            WorkerFailure.PREFIX_HASH_MISMATCH, f"resolved prefix has {prefix.size} ids, prev_len {prev_len}"
        )
    if prompt.size < prev_len or not np.array_equal(prompt[:prev_len], prefix):
        raise CaptureFailure(
            WorkerFailure.PREFIX_SPLICE_FAILED, "prompt does not start with the exact prefix"
        )
    _check_extras(extras, call.generated_ids.size)
    carry = prompt.size - prev_len
    delta_ids = np.concatenate((prompt[prev_len:], call.generated_ids))
    mask = np.concatenate((np.zeros(carry), np.ones(call.generated_ids.size)))
    # Rows hold float32 logprobs; round once so the digest matches the stored row.
    rounded = call.generated_logprobs.astype(np.float32).astype(np.float64)
    logprobs = np.concatenate((np.zeros(carry), rounded))
    try:
        extras_hash = digest.extras_digest(extras)
        chain = digest.chain_hash(prepared.parent_chain_hash, delta_ids)
        cumulative = digest.cumulative_hash(np.concatenate((prompt, call.generated_ids)))
    except EncodingError as exc:
        raise CaptureFailure(WorkerFailure.INVALID_DELTA, str(exc)) from None
    # Unvalidated on purpose: the digest reads the arrays directly, and every rule the
    # model would check has been checked above on the arrays.
    fields: dict[str, Any] = {
        "rollout_id": admission.rollout_id,
        "call_id": admission.call_id,
        "parent_call_id": admission.parent_call_id,
        "mode": admission.mode,
        "prev_len": prev_len,
        "delta_len": int(delta_ids.size),
        "cum_len": prev_len + int(delta_ids.size),
        "weight_version": weight_version,
        "token_ids_delta": delta_ids,
        "token_mask_delta": mask,
        "logprobs_delta": logprobs,
        "extras": extras,
        "extras_digest": extras_hash,
        "chain_hash": chain,
        "cumulative_hash": cumulative,
    }
    body = StagedCallBody.model_construct(**fields)
    key = staging_key(admission.rollout_id, admission.call_id)
    return CommitCoords(
        rollout_id=admission.rollout_id,
        call_id=admission.call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=prev_len,
        delta_len=int(delta_ids.size),
        cum_len=prev_len + int(delta_ids.size),
        weight_version=weight_version,
        staging_key=key,
        staging_chain=[*(admission.staging_chain or []), key],
        chain_hash=chain,
        cumulative_hash=cumulative,
        digest=digest.digest_of_body(body),
        extras_digest=extras_hash,
        disposition="staged",
    )


def failed_coords(admission: CaptureAdmission, code: WorkerFailure, weight_version: int) -> CommitCoords:
    """Coords of a served call whose capture failed, as ``CaptureCore.fail`` reports them."""
    key = staging_key(admission.rollout_id, admission.call_id)
    return CommitCoords(
        rollout_id=admission.rollout_id,
        call_id=admission.call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        delta_len=0,
        cum_len=admission.prev_len,
        weight_version=weight_version,
        staging_key=key,
        staging_chain=[*(admission.staging_chain or []), key],
        disposition="capture_failed",
        failure_reason=code,
    )


def _check_extras(extras: dict[str, Any] | None, generated: int) -> None:
    """The extras rules the row model enforces, so a row never fails where coords passed."""
    if extras is None:
        return
    spans = extras.get(EXTRAS_WEIGHT_SPANS)
    if spans is not None:
        try:
            check_weight_spans(spans, generated)
        except ValueError as exc:
            raise CaptureFailure(WorkerFailure.INVALID_DELTA, str(exc)) from None


__all__ = ["failed_coords", "staged_coords"]
