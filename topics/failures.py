"""Failure codes (DESIGN §6), grouped by the component that raises them."""

from __future__ import annotations

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
    # All-or-nothing: this chain verified, but another chain of its rollout was rejected.
    BRANCH_REJECTED = "branch_rejected"


ALL_FAILURE_CODES: frozenset[str] = frozenset(
    code.value for family in (WorkerFailure, LedgerFailure, FinalizerFailure) for code in family
)
