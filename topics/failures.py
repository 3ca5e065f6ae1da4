"""Failure codes (DESIGN §6), grouped by the component that raises them, each with a
one-line meaning for people reading a rejection (the inspector shows it)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class WorkerFailure(StrEnum):
    """Why a worker could not capture a call (the call itself is still served)."""

    PREFIX_UNAVAILABLE = "prefix_unavailable"
    PREFIX_HASH_MISMATCH = "prefix_hash_mismatch"
    PREFIX_SPLICE_FAILED = "prefix_splice_failed"
    INVALID_DELTA = "invalid_delta"
    STAGING_WRITE_FAILED = "staging_write_failed"
    STAGING_TIMEOUT = "staging_timeout"
    EPOCH_SPAN_REJECTED = "epoch_span_rejected"
    # An admitted call the engine never finished (error, cancelled), reported at once so
    # the ledger need not wait out its grace period.
    NOT_SERVED = "not_served"
    # A streaming client went away before its call finished: the engine stopped
    # generating, so there is no complete row to stage.
    CLIENT_DISCONNECTED = "client_disconnected"


class LedgerFailure(StrEnum):
    """Why the ledger failed a call or a rollout."""

    COORDS_MISMATCH = "coords_mismatch"
    NEVER_STAGED = "never_staged"
    UNKNOWN_ADMISSION = "unknown_admission"
    AMBIGUOUS_TERMINAL = "ambiguous_terminal"
    DECLARED_TERMINAL_MISSING = "declared_terminal_missing"
    NO_CALLS = "no_calls"
    # So that every admitted rollout still gets its one outcome:
    ROLLOUT_FAILED = "rollout_failed"  # the driver sealed the rollout as failed
    INTERRUPTED = "interrupted"  # sealed failed because its run stopped (a signal, or a crash)
    NEVER_SEALED = "never_sealed"  # admitted calls, but no seal within the open limit


class FinalizerFailure(StrEnum):
    """Why the finalizer rejected a rollout after fetching its rows."""

    MISSING_ROW = "missing_row"
    ROW_IDENTITY_MISMATCH = "row_identity_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    LENGTH_MISMATCH = "length_mismatch"
    CHAIN_HASH_MISMATCH = "chain_hash_mismatch"
    CUMULATIVE_HASH_MISMATCH = "cumulative_hash_mismatch"
    INVALID_MASK = "invalid_mask"
    EMPTY_GENERATION = "empty_generation"
    MIXED_WEIGHT_VERSIONS = "mixed_weight_versions"
    INVALID_PROVENANCE = "invalid_provenance"
    # All-or-nothing: this chain verified, but another chain of its rollout was rejected.
    BRANCH_REJECTED = "branch_rejected"


ALL_FAILURE_CODES: frozenset[str] = frozenset(
    code.value for family in (WorkerFailure, LedgerFailure, FinalizerFailure) for code in family
)

MEANINGS: Mapping[str, str] = {
    WorkerFailure.PREFIX_UNAVAILABLE: "an ancestor's row could not be read while the worker rebuilt the prompt",
    WorkerFailure.PREFIX_HASH_MISMATCH: "an ancestor's row or the prefix disagrees with the admitted chain",
    WorkerFailure.PREFIX_SPLICE_FAILED: "the earlier tokens could not be spliced into this call's prompt (§5)",
    WorkerFailure.INVALID_DELTA: "the engine's output could not become a valid row",
    WorkerFailure.STAGING_WRITE_FAILED: "the row could not be put into the data plane",
    WorkerFailure.STAGING_TIMEOUT: "putting the row into the data plane took longer than its timeout",
    WorkerFailure.EPOCH_SPAN_REJECTED: "the call straddled a refit and the span policy rejects that",
    WorkerFailure.NOT_SERVED: "an admitted call that the engine never finished",
    WorkerFailure.CLIENT_DISCONNECTED: "the streaming client went away before the call finished",
    LedgerFailure.COORDS_MISMATCH: "what was staged does not continue what was admitted, or a child its parent",
    LedgerFailure.NEVER_STAGED: "admitted and sealed, but no row was staged before the grace period ended",
    LedgerFailure.UNKNOWN_ADMISSION: "a staged call, or a chain ancestor, that was never admitted",
    LedgerFailure.AMBIGUOUS_TERMINAL: "more than one chain could be the episode's end (§4.4)",
    LedgerFailure.DECLARED_TERMINAL_MISSING: "the seal named a terminal call the rollout does not have",
    LedgerFailure.NO_CALLS: "sealed without a single captured call",
    LedgerFailure.ROLLOUT_FAILED: "the environment sealed the rollout as failed",
    LedgerFailure.INTERRUPTED: "its run stopped (a signal or a crash) before the rollout ended",
    LedgerFailure.NEVER_SEALED: "admitted calls, but no seal within the open limit",
    FinalizerFailure.MISSING_ROW: "a row of the chain could not be read from the data plane",
    FinalizerFailure.ROW_IDENTITY_MISMATCH: "a fetched row belongs to another call",
    FinalizerFailure.DIGEST_MISMATCH: "a row's bytes do not hash to the digest its staging recorded",
    FinalizerFailure.LENGTH_MISMATCH: "a row's lengths or weight spans disagree with its coords",
    FinalizerFailure.CHAIN_HASH_MISMATCH: "a row does not chain onto its parent's hash",
    FinalizerFailure.CUMULATIVE_HASH_MISMATCH: "the spliced sample's tokens differ from what the chain committed",
    FinalizerFailure.INVALID_MASK: "the loss mask is not 0/1 or marks no generated token correctly",
    FinalizerFailure.EMPTY_GENERATION: "the sample has no generated token",
    FinalizerFailure.MIXED_WEIGHT_VERSIONS: "the sample's tokens come from weight versions the policy forbids mixing",
    FinalizerFailure.INVALID_PROVENANCE: "a row's sampling provenance is malformed (written wrong at its source)",
    FinalizerFailure.BRANCH_REJECTED: "this chain verified, but another chain of its rollout was rejected",
}
