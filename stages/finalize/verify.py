"""Verification (DESIGN §4.5) and linearization of the chains of a rollout.

Checks run in a fixed order so that each corruption maps to exactly one code:
identity, lengths, mask, digest, chain hash, weight versions, sampling provenance,
cumulative hash, mixed weight versions. The
digest covers every field of a row, so a row that passes it and still fails a later
check was written wrong at the source, not damaged on the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from stages.finalize.vectors import ChainVectors
from topics.canonical import EncodingError
from topics.digest import (
    chain_hash_of_canonical,
    cumulative_hash_of_parts,
    digest_of_canonical,
    extras_digest,
)
from topics.failures import FinalizerFailure
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    ROW_SCHEMA_VERSION,
    CallSpan,
    ManifestEntry,
    RolloutReceipt,
    SampleChain,
    StagedCall,
    TrainingSample,
    assemble,
    check_weight_spans,
    staging_key,
)
from topics.sampling import SamplingProvenance, provenance_of


class MixedVersionPolicy(StrEnum):
    ALLOW = "allow"
    REJECT = "reject"


class Rejected(Exception):
    """The rollout cannot become a sample; ``code`` says why."""

    def __init__(self, code: FinalizerFailure, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Linearized:
    sample: TrainingSample
    prompt_len: int
    generated_tokens: int
    call_count: int
    min_weight_version: int
    max_weight_version: int


def chain_records(receipt: RolloutReceipt, leaf_call_id: str) -> list[ManifestEntry]:
    """The manifest entries from root to ``leaf_call_id``, following parent links."""
    by_id = {record.call_id: record for record in receipt.manifest}
    chain: list[ManifestEntry] = []
    current: str | None = leaf_call_id
    while current is not None:
        record = by_id.get(current)
        if record is None or len(chain) > len(by_id):
            raise Rejected(
                FinalizerFailure.MISSING_ROW, f"call {current} of the chain is not in the manifest"
            )
        chain.append(record)
        current = record.parent_call_id
    chain.reverse()
    return chain


def linearize(
    receipt: RolloutReceipt,
    target: SampleChain,
    rows: Mapping[str, StagedCall],
    policy: MixedVersionPolicy = MixedVersionPolicy.ALLOW,
) -> Linearized:
    """Verify every row of one chain and concatenate them into its sample.

    The rows' vectors are checked as one array per field (``ChainVectors``); a row's
    checks still run in the fixed order, rows in chain order, so the first problem of
    the chain is the one reported, as if each row were checked alone."""
    chain = chain_records(receipt, target.leaf_call_id)
    found, unusable = _usable_rows(receipt, chain, rows)
    try:
        vectors = ChainVectors.of(found)
    except (TypeError, ValueError, OverflowError) as exc:  # only a row built by hand holds such values
        raise Rejected(
            FinalizerFailure.DIGEST_MISMATCH, f"{receipt.rollout_id}: cannot be encoded ({exc})"
        ) from None
    spans: list[CallSpan] = []
    versions: list[npt.NDArray[np.int64]] = []
    parent_hash: str | None = None
    for index, (record, row) in enumerate(zip(chain[: len(found)], found, strict=True)):
        _check_mask(row.staging_key, vectors, index)
        _check_digest(record, row, vectors, index)
        parent_hash = chain_hash_of_canonical(parent_hash, vectors.ids_canonical[vectors.span(index)])
        if parent_hash != row.chain_hash or parent_hash != record.chain_hash:
            raise Rejected(
                FinalizerFailure.CHAIN_HASH_MISMATCH, f"chain hash of {row.staging_key} does not recompute"
            )
        carry = vectors.carry(index)
        versions.append(_token_versions(row, carry))
        sampling = _provenance(row)
        # Every value is checked by now (the call id is the manifest's), so no validation.
        spans.append(
            assemble(
                CallSpan,
                {
                    "schema_version": ROW_SCHEMA_VERSION,
                    "call_id": row.call_id,
                    "start": row.prev_len,
                    "carry_len": carry,
                    "gen_len": row.delta_len - carry,
                    "reward": receipt.call_rewards.get(row.call_id),
                    "sampling": sampling,
                },
            )
        )
    if unusable is not None:
        raise unusable
    leaf_row = found[-1]
    linear_hash = cumulative_hash_of_parts(vectors.ids_canonical)
    if linear_hash != leaf_row.cumulative_hash or linear_hash != target.cumulative_hash:
        raise Rejected(
            FinalizerFailure.CUMULATIVE_HASH_MISMATCH, "linearized ids do not match the leaf's hash"
        )
    all_versions = np.concatenate(versions)
    low, high = int(all_versions.min()), int(all_versions.max())
    if policy is MixedVersionPolicy.REJECT and low != high:
        raise Rejected(FinalizerFailure.MIXED_WEIGHT_VERSIONS, f"weight versions {low}..{high}")
    sample = TrainingSample.model_construct(
        schema_version=ROW_SCHEMA_VERSION,
        rollout_id=receipt.rollout_id,
        group_id=receipt.group_id,
        token_ids=vectors.ids.tolist(),
        token_mask=vectors.mask.tolist(),
        logprobs=vectors.logprobs.tolist(),
        weight_versions=all_versions.tolist(),
        spans=spans,
        reward=receipt.reward,
        cumulative_hash=linear_hash,
        sample_key=None if target.key == receipt.rollout_id else target.key,
    )
    return Linearized(sample, spans[0].carry_len, int(vectors.generated.sum()), len(chain), low, high)


def _usable_rows(
    receipt: RolloutReceipt, chain: list[ManifestEntry], rows: Mapping[str, StagedCall]
) -> tuple[list[StagedCall], Rejected | None]:
    """The chain's rows up to the first that is missing, not the manifest's, or of the
    wrong lengths, and why that one is not usable (None when all are). The rows before
    it are checked first: their problems come earlier in the chain."""
    found: list[StagedCall] = []
    length = 0
    for record in chain:
        key = staging_key(receipt.rollout_id, record.call_id)
        row = rows.get(key)
        try:
            if row is None:
                raise Rejected(FinalizerFailure.MISSING_ROW, f"no row under {key}")
            _check_identity(receipt, record, row)
            _check_lengths(record, row, length)
        except Rejected as exc:
            if not found:
                raise
            return found, exc
        found.append(row)
        length = row.cum_len
    return found, None


def _check_identity(receipt: RolloutReceipt, record: ManifestEntry, row: StagedCall) -> None:
    if (
        row.rollout_id != receipt.rollout_id
        or row.call_id != record.call_id
        or row.parent_call_id != record.parent_call_id
        or row.mode != record.mode
    ):
        raise Rejected(
            FinalizerFailure.ROW_IDENTITY_MISMATCH,
            f"row under {staging_key(receipt.rollout_id, record.call_id)} is {row.rollout_id}/{row.call_id}"
            f" (parent {row.parent_call_id})",
        )
    if row.schema_version != ROW_SCHEMA_VERSION:
        raise Rejected(FinalizerFailure.ROW_IDENTITY_MISMATCH, f"row schema_version {row.schema_version}")


def _check_lengths(record: ManifestEntry, row: StagedCall, expected_prev_len: int) -> None:
    n = row.delta_len
    if not (len(row.token_ids_delta) == len(row.token_mask_delta) == len(row.logprobs_delta) == n):
        raise Rejected(
            FinalizerFailure.LENGTH_MISMATCH, f"{row.staging_key}: vectors disagree with delta_len {n}"
        )
    if row.prev_len + n != row.cum_len or row.prev_len != expected_prev_len:
        raise Rejected(
            FinalizerFailure.LENGTH_MISMATCH,
            f"{row.staging_key}: prev_len {row.prev_len} + {n} vs cum_len {row.cum_len}, parent ends at {expected_prev_len}",
        )
    if (row.prev_len, row.cum_len) != (record.prev_len, record.cum_len):
        raise Rejected(
            FinalizerFailure.LENGTH_MISMATCH, f"{row.staging_key}: row lengths differ from the ledger's"
        )


def _check_mask(key: str, vectors: ChainVectors, index: int) -> None:
    if vectors.stray_mask[index]:
        raise Rejected(FinalizerFailure.INVALID_MASK, f"{key}: mask values other than 0.0/1.0")
    if vectors.generated[index] == 0:
        raise Rejected(FinalizerFailure.EMPTY_GENERATION, f"{key}: no generated token")
    if vectors.out_of_order[index]:
        raise Rejected(FinalizerFailure.INVALID_MASK, f"{key}: mask is not zeros then ones")


def _check_digest(record: ManifestEntry, row: StagedCall, vectors: ChainVectors, index: int) -> None:
    """The row's digest recomputed from its slice of the chain's canonical vectors."""
    if vectors.negative_ids[index] or vectors.not_finite[index]:
        problem = "negative token ids" if vectors.negative_ids[index] else "values that are not finite"
        raise Rejected(FinalizerFailure.DIGEST_MISMATCH, f"{row.staging_key}: cannot be encoded ({problem})")
    where = vectors.span(index)
    try:
        extras_ok = extras_digest(row.extras) == row.extras_digest
    except EncodingError as exc:
        raise Rejected(
            FinalizerFailure.DIGEST_MISMATCH, f"{row.staging_key}: cannot be encoded ({exc})"
        ) from None
    recomputed = digest_of_canonical(
        row, vectors.ids_canonical[where], vectors.mask_canonical[where], vectors.logprobs_canonical[where]
    )
    if recomputed != row.digest or recomputed != record.digest or not extras_ok:
        raise Rejected(FinalizerFailure.DIGEST_MISMATCH, f"{row.staging_key}: digest does not recompute")


def _provenance(row: StagedCall) -> SamplingProvenance | None:
    try:
        return provenance_of(row.extras)
    except ValueError as exc:
        raise Rejected(FinalizerFailure.INVALID_PROVENANCE, f"{row.staging_key}: {exc}") from None


def _token_versions(row: StagedCall, carry: int) -> npt.NDArray[np.int64]:
    """Per-token weight versions: the call's own, or its refit spans over the generation."""
    versions = np.full(row.delta_len, row.weight_version, dtype=np.int64)
    spans = (row.extras or {}).get(EXTRAS_WEIGHT_SPANS)
    if spans is not None:
        try:
            check_weight_spans(spans, row.delta_len - carry)
        except ValueError as exc:
            raise Rejected(FinalizerFailure.LENGTH_MISMATCH, f"{row.staging_key}: {exc}") from None
        for offset, version in spans:
            versions[carry + offset :] = version
    return versions
