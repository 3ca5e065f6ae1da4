"""The records of DESIGN §4.2 as strict pydantic v2 models.

Every model forbids unknown fields, refuses type coercion and non-finite floats,
and carries ``schema_version``; a reader rejects versions it does not know, so a
newer producer can never be half-understood. Invariants are checked with numpy so
that validating a 32K-token row costs microseconds per thousand tokens.

Two schemas are versioned apart (DESIGN §4.6): data-plane rows and samples
(``RowRecord``: NeMo Gym schema 3, byte for byte, digests included) and events on the
topics (``EventRecord``: schema 4, read in a two-version window: a schema-3 event is
read into the schema-4 record, so a cluster upgrades one process at a time).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from topics import canonical
from topics.failures import FinalizerFailure, LedgerFailure, WorkerFailure
from topics.sampling import SamplingProvenance, provenance_of

ROW_SCHEMA_VERSION = 3
"""Rows and samples in the data plane: NeMo Gym's schema 3, kept byte-compatible."""
EVENT_SCHEMA_VERSION = 4
"""Events on the topics. Schema 4: only the admission carries the staging chain."""
READABLE_EVENT_SCHEMAS = (3, 4)
"""The window: readers accept the current event schema and the one before it."""
SCHEMA_VERSION = ROW_SCHEMA_VERSION
"""The public name of the row schema (NeMo Gym's), kept stable for digest users."""
DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

EXTRAS_WEIGHT_SPANS = "weight_version_spans"
"""Extras key for a call that straddles a refit: ``[[generated_offset, version], ...]``,
ascending offsets starting at 0; token ``i`` of the generation has the version of the
last span whose offset is <= i."""

MAX_CHAIN_DEPTH = 16_384
"""Most calls on one chain, root through the call itself. The chain travels in every
admission (and the worker's reply, ``CommitCoords``), so it must stay bounded; an
admission that claims more is refused where it enters (HTTP 400, or a dead letter).
With the longest keys (401 bytes) the event limit binds first, near 10,000 keys."""

IDENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
STAGING_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"
SAMPLE_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._-]*)?$"

RolloutId = Annotated[str, StringConstraints(pattern=IDENT_PATTERN, max_length=200)]
CallId = Annotated[str, StringConstraints(pattern=IDENT_PATTERN, max_length=200)]
StagingKey = Annotated[str, StringConstraints(pattern=STAGING_KEY_PATTERN, max_length=401)]
SampleKey = Annotated[str, StringConstraints(pattern=SAMPLE_KEY_PATTERN, max_length=401)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
AncestorKeys = Annotated[list[StagingKey], Field(max_length=MAX_CHAIN_DEPTH - 1)]
ChainKeys = Annotated[list[StagingKey], Field(max_length=MAX_CHAIN_DEPTH)]
Label = Annotated[str, StringConstraints(min_length=1, max_length=200)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0, lt=2**63)]
Timestamp = Annotated[float, Field(ge=0.0)]
Mode = Literal["text", "token_in"]
SamplePolicy = Literal["terminal", "leaves", "chains"]
"""Which chains of a rollout's call tree become samples (DESIGN §4.4): the one terminal
chain, every root-to-leaf chain, or each root's longest chain."""
HistoryPolicy = Literal["exact", "render"]
"""What a continuation's prompt holds of the earlier turns: their exact tokens (``exact``,
the default), or what the chat template renders of them (``render``: where that does not
extend the parent's tokens, the call starts a new segment, DESIGN §5.1)."""
Disposition = Literal["staged", "capture_failed"]
ExtrasDict = dict[str, Any]
# Codes are enums in Python and plain strings on the wire: accept the string form.
WorkerCode = Annotated[WorkerFailure, Field(strict=False)]
LedgerCode = Annotated[LedgerFailure, Field(strict=False)]
FinalizerCode = Annotated[FinalizerFailure, Field(strict=False)]
FailureCode = WorkerCode | LedgerCode
RejectionCode = WorkerCode | LedgerCode | FinalizerCode


def staging_key(rollout_id: str, call_id: str) -> str:
    """The data-plane key of one call's row."""
    return f"{rollout_id}/{call_id}"


def sample_key(rollout_id: str, leaf_call_id: str | None = None) -> str:
    """The data-plane key of a sample: the rollout id for the one terminal sample, else
    the rollout id and the chain's leaf (``@`` is in no id, so keys never collide)."""
    return rollout_id if leaf_call_id is None else f"{rollout_id}@{leaf_call_id}"


M = TypeVar("M", bound=BaseModel)


def assemble(model: type[M], values: dict[str, Any]) -> M:
    """A record from values already checked, every field given and nothing else.

    The same record ``model_construct`` builds (tested equal), at a quarter of its cost:
    the ledger joins validated records and the capture path copies them, once per call.
    ``values`` becomes the record's own, so pass a dict nobody else keeps.
    """
    names = model.__pydantic_fields__.keys()
    if values.keys() != names:
        missing, unknown = sorted(names - values.keys()), sorted(values.keys() - names)
        raise ValueError(f"{model.__name__}: missing fields {missing}, unknown fields {unknown}")
    record = model.__new__(model)
    object.__setattr__(record, "__dict__", values)
    object.__setattr__(record, "__pydantic_fields_set__", set(values))
    object.__setattr__(record, "__pydantic_extra__", None)
    object.__setattr__(record, "__pydantic_private__", None)
    return record


class Record(BaseModel):
    """Base of every record: strict, closed, finite, versioned."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    schema_version: int


class RowRecord(Record):
    """A row or sample in the data plane: exactly schema 3."""

    schema_version: int = ROW_SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value != ROW_SCHEMA_VERSION:
            raise ValueError(f"unsupported schema_version {value}; rows are {ROW_SCHEMA_VERSION}")
        return value


class EventRecord(Record):
    """An event: written as schema 4; a schema-3 event is read into this schema-4 record."""

    schema_version: int = EVENT_SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value != EVENT_SCHEMA_VERSION:  # a readable older version was upgraded before this
            raise ValueError(
                f"unsupported schema_version {value}; this reader knows {READABLE_EVENT_SCHEMAS}"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("schema_version") == 3:
            return cls._from_v3({**data, "schema_version": EVENT_SCHEMA_VERSION})
        return data

    @classmethod
    def _from_v3(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A schema-3 payload as the schema-4 fields (most events did not change)."""
        return data


def added_in_4(default: Any) -> Any:
    """A field added to schema 4 after it shipped, written only when it differs from its
    ``default``: events that do not use it stay byte for byte what older readers know.
    Per field (``exclude_if``), so serializing stays in pydantic's Rust core; a model-wide
    wrap serializer built the whole event as Python objects first (a receipt 13 µs)."""
    return Field(default, exclude_if=lambda value: value == default)


def _check_lineage(mode: str, parent_call_id: str | None, prev_len: int) -> None:
    """``text`` ⇔ no parent ⇔ prev_len 0 (the rule shared by admission and rows)."""
    if mode == "text":
        if parent_call_id is not None:
            raise ValueError("parent_call_id: a text-mode call has no parent")
        if prev_len != 0:
            raise ValueError("prev_len: a text-mode call has prev_len 0")
    else:
        if parent_call_id is None:
            raise ValueError("parent_call_id: a token_in call needs its parent")
        if prev_len <= 0:
            raise ValueError("prev_len: a token_in call needs prev_len > 0")


def _check_chain(rollout_id: str, chain: list[str] | None, field: str) -> None:
    if chain is None:
        return
    if not chain:
        raise ValueError(f"{field}: an empty list does not stand for 'no prefix'; omit the field")
    prefix = f"{rollout_id}/"
    for key in chain:
        if not key.startswith(prefix):
            raise ValueError(f"{field}: key {key!r} is not of rollout {rollout_id!r}")
    if len(set(chain)) != len(chain):
        raise ValueError(f"{field}: a key repeats (cyclic chain)")


def _check_extras(extras: ExtrasDict | None) -> None:
    if extras is not None:
        try:
            canonical.extras(extras)
        except canonical.EncodingError as exc:
            raise ValueError(str(exc)) from None


class CaptureAdmission(EventRecord):
    """The driver's statement that a call is about to run, and on which prefix."""

    rollout_id: RolloutId
    call_id: CallId
    parent_call_id: CallId | None = None
    prev_len: Count
    mode: Mode
    staging_chain: AncestorKeys | None = None
    parent_chain_hash: Sha256Hex | None = None
    logical_call_id: Label | None = None
    group_id: Label | None = None
    admitted_at: Timestamp
    history: HistoryPolicy = added_in_4("exact")

    @model_validator(mode="after")
    def _rules(self) -> CaptureAdmission:
        _check_lineage(self.mode, self.parent_call_id, self.prev_len)
        _check_chain(self.rollout_id, self.staging_chain, "staging_chain")
        if self.mode == "text":
            if self.staging_chain is not None:
                raise ValueError("staging_chain: a text-mode call has no chain")
            if self.parent_chain_hash is not None:
                raise ValueError("parent_chain_hash: a text-mode call has no parent chain hash")
        else:
            if self.staging_chain is None:
                raise ValueError("staging_chain: a token_in call needs its ancestors' keys")
            if self.parent_chain_hash is None:
                raise ValueError("parent_chain_hash: a token_in call needs its parent's chain hash")
            assert self.parent_call_id is not None
            if self.staging_chain[-1] != staging_key(self.rollout_id, self.parent_call_id):
                raise ValueError("staging_chain: the last key must be the parent's staging key")
            if staging_key(self.rollout_id, self.call_id) in self.staging_chain:
                raise ValueError("staging_chain: a call cannot be its own ancestor")
        return self

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.call_id)


def chain_fingerprints(chain: list[str] | None, own_key: str) -> tuple[bytes, bytes]:
    """Digests of a call's ancestors' keys and of those keys plus its own: a child's first
    must equal its parent's second, which the ledger checks without keeping any chain."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update("\n".join(chain or ()).encode())
    ancestry = hasher.digest()
    hasher.update((("\n" if chain else "") + own_key).encode())
    return ancestry, hasher.digest()


class StagedCallBody(RowRecord):
    """Every field of a staged row except its digest: what ``call_digest`` covers."""

    rollout_id: RolloutId
    call_id: CallId
    parent_call_id: CallId | None = None
    mode: Mode
    prev_len: Count
    delta_len: Annotated[int, Field(ge=1)]
    cum_len: Count
    weight_version: Count
    token_ids_delta: list[TokenId]
    token_mask_delta: list[float]
    logprobs_delta: list[float]
    extras: ExtrasDict | None = None
    extras_digest: Sha256Hex
    chain_hash: Sha256Hex
    cumulative_hash: Sha256Hex

    @model_validator(mode="after")
    def _rules(self) -> StagedCallBody:
        _check_lineage(self.mode, self.parent_call_id, self.prev_len)
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError(
                f"cum_len: {self.cum_len} != prev_len {self.prev_len} + delta_len {self.delta_len}"
            )
        check_delta(self.token_ids_delta, self.token_mask_delta, self.logprobs_delta, self.delta_len)
        _check_extras(self.extras)
        if self.extras is not None and EXTRAS_WEIGHT_SPANS in self.extras:
            generated = int(sum(self.token_mask_delta))
            check_weight_spans(self.extras[EXTRAS_WEIGHT_SPANS], generated)
        provenance_of(self.extras)
        return self

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.call_id)


def check_delta(token_ids: list[int], mask: list[float], logprobs: list[float], delta_len: int) -> None:
    """The row rules of DESIGN §4.2: lengths, mask shape, zero logprobs under mask 0."""
    if len(token_ids) != delta_len:
        raise ValueError(f"token_ids_delta: length {len(token_ids)} != delta_len {delta_len}")
    if len(mask) != delta_len:
        raise ValueError(f"token_mask_delta: length {len(mask)} != delta_len {delta_len}")
    if len(logprobs) != delta_len:
        raise ValueError(f"logprobs_delta: length {len(logprobs)} != delta_len {delta_len}")
    mask_array = np.asarray(mask, dtype=np.float64)
    ones = mask_array == 1.0
    if not (ones | (mask_array == 0.0)).all():
        raise ValueError("token_mask_delta: values must be 0.0 or 1.0")
    generated = int(ones.sum())
    if generated == 0:
        raise ValueError("token_mask_delta: at least one generated token (mask 1.0) is required")
    if not ones[delta_len - generated :].all():
        raise ValueError("token_mask_delta: must be all zeros then all ones")
    logprob_array = np.asarray(logprobs, dtype=np.float64)
    if not np.isfinite(logprob_array).all():
        raise ValueError("logprobs_delta: must be finite (no NaN or Inf)")
    if (logprob_array[: delta_len - generated] != 0.0).any():
        raise ValueError("logprobs_delta: must be 0.0 wherever the mask is 0")


def check_weight_spans(spans: Any, generated: int) -> None:
    """``[[offset, version], ...]``: offsets ascend from 0 and stay inside the generation."""
    field = f"extras.{EXTRAS_WEIGHT_SPANS}"
    if type(spans) is not list or not spans:
        raise ValueError(f"{field}: must be a non-empty list of [offset, version] pairs")
    previous = -1
    for pair in spans:
        if type(pair) is not list or len(pair) != 2 or any(type(v) is not int or v < 0 for v in pair):
            raise ValueError(f"{field}: {pair!r} is not a pair of non-negative ints")
        if pair[0] <= previous or pair[0] >= generated:
            raise ValueError(f"{field}: offsets must ascend within the {generated} generated tokens")
        previous = pair[0]
    if spans[0][0] != 0:
        raise ValueError(f"{field}: the first span starts at offset 0")


class StagedCall(StagedCallBody):
    """The heavy per-call row; it lives only in the data plane."""

    digest: Sha256Hex


class CallCoords(EventRecord):
    """Light coordinates of a captured call, as its staged event and call record carry them.

    A ``staged`` call carries every hash; a ``capture_failed`` call carries its code and
    whatever was known when capture failed. The parent is named by id; the chain of keys
    is not repeated (schema 4), so the event is the same size at any depth.
    """

    rollout_id: RolloutId
    call_id: CallId
    parent_call_id: CallId | None = None
    mode: Mode
    prev_len: Count
    delta_len: Count
    cum_len: Count
    weight_version: Count
    staging_key: StagingKey
    chain_hash: Sha256Hex | None = None
    cumulative_hash: Sha256Hex | None = None
    digest: Sha256Hex | None = None
    extras_digest: Sha256Hex | None = None
    disposition: Disposition
    failure_reason: WorkerCode | None = None

    @classmethod
    def _from_v3(cls, data: dict[str, Any]) -> dict[str, Any]:
        chain = data.pop("staging_chain", None)
        if not isinstance(chain, list) or not chain or chain[-1] != data.get("staging_key"):
            raise ValueError("staging_chain: must end with the call's own staging key")
        return data

    @model_validator(mode="after")
    def _rules(self) -> CallCoords:
        _check_lineage(self.mode, self.parent_call_id, self.prev_len)
        if self.staging_key != staging_key(self.rollout_id, self.call_id):
            raise ValueError("staging_key: must be '{rollout_id}/{call_id}'")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError(
                f"cum_len: {self.cum_len} != prev_len {self.prev_len} + delta_len {self.delta_len}"
            )
        if self.disposition == "staged":
            if self.failure_reason is not None:
                raise ValueError("failure_reason: a staged call has no failure reason")
            if self.delta_len < 1:
                raise ValueError("delta_len: a staged call has at least one token")
            for name in ("chain_hash", "cumulative_hash", "digest", "extras_digest"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: required for a staged call")
        elif self.failure_reason is None:
            raise ValueError("failure_reason: required when disposition is capture_failed")
        return self


class CommitCoords(CallCoords):
    """The worker's reply to the driver (``ng_commit_coords``): the coords plus the chain
    of staging keys, root through this call, from which the next admission is built."""

    staging_chain: ChainKeys

    @classmethod
    def _from_v3(cls, data: dict[str, Any]) -> dict[str, Any]:
        return data

    @model_validator(mode="after")
    def _chain_rules(self) -> CommitCoords:
        _check_chain(self.rollout_id, self.staging_chain, "staging_chain")
        if self.staging_chain[-1] != self.staging_key:
            raise ValueError("staging_chain: must end with the call's own staging key")
        return self

    def call_coords(self) -> CallCoords:
        """The coords without the chain, as the staged event carries them (no re-validation)."""
        return assemble(
            CallCoords, {name: value for name, value in self.__dict__.items() if name != "staging_chain"}
        )


class StagedEvent(EventRecord):
    """Published by a worker's background writer once a row is written (or failed)."""

    coords: CallCoords
    response_id: Label | None = None
    worker_id: Label
    staged_at: Timestamp


class CallRecord(CallCoords):
    """A ledger row: the coords of one committed call, joined with its admission."""

    response_id: Label | None = None
    logical_call_id: Label | None = None
    admitted_at: Timestamp
    staged_at: Timestamp


class FailedCall(EventRecord):
    """A call that was admitted but will never be part of a sample."""

    rollout_id: RolloutId
    call_id: CallId
    parent_call_id: CallId | None = None
    reason: FailureCode
    detail: str | None = None


class RolloutSeal(EventRecord):
    """The driver's statement that a rollout is over (no more calls will be admitted)."""

    rollout_id: RolloutId
    group_id: Label | None = None
    reward: float | None = None
    terminal_call_id: CallId | None = None
    terminal_response_id: Label | None = None
    status: Literal["completed", "failed"]
    failure_reason: Label | None = None
    sealed_at: Timestamp
    sample_policy: SamplePolicy = added_in_4("terminal")
    all_or_nothing: bool | None = added_in_4(None)
    """Reject every sample when one chain is rejected; None: the finalizer's default."""
    sealed_by: Label | None = added_in_4(None)
    """The principal that sealed (``environment:1a2b3c4d``; a name, never a secret)."""
    call_rewards: dict[CallId, FiniteFloat] = added_in_4({})
    """Per-call (process) rewards, by call id, beside the rollout's ``reward``."""

    @model_validator(mode="after")
    def _rules(self) -> RolloutSeal:
        if self.terminal_call_id is not None and self.terminal_response_id is not None:
            raise ValueError("terminal_call_id: declare the terminal by call id or response id, not both")
        declared = self.terminal_call_id is not None or self.terminal_response_id is not None
        if declared and self.sample_policy != "terminal":
            raise ValueError("sample_policy: a declared terminal needs sample_policy terminal")
        if self.status == "failed" and self.failure_reason is None:
            raise ValueError("failure_reason: required when status is failed")
        return self


class ManifestEntry(BaseModel):
    """One committed call in a receipt: what the finalizer verifies its row against.

    Compact on purpose (no rollout id, staging key or chain: the receipt's rollout and
    the parent links give them), so a receipt grows linearly, about 260 bytes a call."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    call_id: CallId
    parent_call_id: CallId | None = None
    mode: Mode
    prev_len: Count
    delta_len: Annotated[int, Field(ge=1)]
    chain_hash: Sha256Hex
    digest: Sha256Hex

    @model_validator(mode="after")
    def _rules(self) -> ManifestEntry:
        _check_lineage(self.mode, self.parent_call_id, self.prev_len)
        return self

    @property
    def cum_len(self) -> int:
        return self.prev_len + self.delta_len

    @classmethod
    def of(cls, record: CallRecord) -> ManifestEntry:
        """The entry of a committed (validated, ``staged``) call record."""
        assert record.chain_hash is not None and record.digest is not None  # staged: both set
        return assemble(
            cls,
            {
                "call_id": record.call_id,
                "parent_call_id": record.parent_call_id,
                "mode": record.mode,
                "prev_len": record.prev_len,
                "delta_len": record.delta_len,
                "chain_hash": record.chain_hash,
                "digest": record.digest,
            },
        )


_ENTRY_FIELDS = tuple(ManifestEntry.model_fields)


class ReceiptChain(BaseModel):
    """One chain a multi-sample receipt asks the finalizer for: its leaf, and the hash the
    linearized chain must have, or the code that already rejects it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    leaf_call_id: CallId
    cumulative_hash: Sha256Hex | None = None
    failure_reason: FailureCode | None = None

    @model_validator(mode="after")
    def _rules(self) -> ReceiptChain:
        if (self.cumulative_hash is None) == (self.failure_reason is None):
            raise ValueError("cumulative_hash: a chain has its hash or its failure_reason, exactly one")
        return self


class RolloutReceipt(EventRecord):
    """The ledger's verdict on a sealed rollout: what to finalize, or why not.

    Under ``sample_policy`` terminal the ``terminal_*`` fields name the one chain; under
    ``leaves`` or ``chains`` the ``chains`` list names every chain, each with its hash or
    its own rejection, and the receipt is poisoned only when none can become a sample."""

    rollout_id: RolloutId
    group_id: Label | None = None
    reward: float | None = None
    manifest: list[ManifestEntry]
    failed_calls: list[FailedCall]
    terminal_call_id: CallId | None = None
    terminal_selection: Literal["declared", "unique_leaf"] | None = None
    terminal_cumulative_hash: Sha256Hex | None = None
    """The terminal call's cumulative hash: what the linearized sample must hash to."""
    capture_poisoned: bool
    failure_reason: FailureCode | None = None
    sealed_at: Timestamp
    sample_policy: SamplePolicy = added_in_4("terminal")
    all_or_nothing: bool | None = added_in_4(None)
    chains: list[ReceiptChain] = added_in_4([])
    call_rewards: dict[CallId, FiniteFloat] = added_in_4({})
    """The seal's per-call rewards, which the finalizer puts on each sample's spans."""

    @classmethod
    def _from_v3(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Schema 3 carried whole call records (chains included) in the manifest."""
        records = data.get("manifest")
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            return data  # not a list of objects: the schema-4 rules say what is wrong
        data["manifest"] = [{name: r[name] for name in _ENTRY_FIELDS if name in r} for r in records]
        terminal = [r for r in records if r.get("call_id") == data.get("terminal_call_id")]
        if terminal:
            data["terminal_cumulative_hash"] = terminal[0].get("cumulative_hash")
        return data

    @model_validator(mode="after")
    def _rules(self) -> RolloutReceipt:
        if self.sample_policy != "terminal":
            self._check_chains()
        elif self.chains:
            raise ValueError("chains: only a leaves or chains policy lists chains")
        elif self.capture_poisoned:
            if self.failure_reason is None:
                raise ValueError("failure_reason: required for a poisoned receipt")
        else:
            if self.terminal_call_id is None or self.terminal_selection is None:
                raise ValueError("terminal_call_id: a receipt that is not poisoned names its terminal")
            if self.terminal_call_id not in {entry.call_id for entry in self.manifest}:
                raise ValueError("terminal_call_id: the terminal must be in the manifest")
            if self.terminal_cumulative_hash is None:
                raise ValueError("terminal_cumulative_hash: a receipt that is not poisoned carries it")
        for failed in self.failed_calls:
            if failed.rollout_id != self.rollout_id:
                raise ValueError(f"failed_calls: call {failed.call_id} belongs to {failed.rollout_id}")
        return self

    def _check_chains(self) -> None:
        if self.terminal_call_id is not None or self.terminal_cumulative_hash is not None:
            raise ValueError("terminal_call_id: a multi-sample receipt names its chains instead")
        served = {entry.call_id for entry in self.manifest}
        leaves = [chain.leaf_call_id for chain in self.chains]
        if len(set(leaves)) != len(leaves):
            raise ValueError("chains: a leaf repeats")
        for chain in self.chains:
            if chain.cumulative_hash is not None and chain.leaf_call_id not in served:
                raise ValueError(f"chains: leaf {chain.leaf_call_id} is not in the manifest")
        sampled = any(chain.cumulative_hash is not None for chain in self.chains)
        if self.capture_poisoned == sampled:
            raise ValueError("capture_poisoned: true exactly when no chain can become a sample")
        if self.capture_poisoned and self.failure_reason is None:
            raise ValueError("failure_reason: required for a poisoned receipt")
        if not self.capture_poisoned and self.failure_reason is not None:
            raise ValueError("failure_reason: only a poisoned receipt has one")

    def sample_chains(self) -> list[SampleChain]:
        """Every chain the finalizer verifies and linearizes into a sample."""
        if self.sample_policy == "terminal":
            if self.capture_poisoned or self.terminal_call_id is None:
                return []
            assert self.terminal_cumulative_hash is not None
            return [SampleChain(self.rollout_id, self.terminal_call_id, self.terminal_cumulative_hash)]
        return [
            SampleChain(
                sample_key(self.rollout_id, chain.leaf_call_id), chain.leaf_call_id, chain.cumulative_hash
            )
            for chain in self.chains
            if chain.cumulative_hash is not None
        ]


class SampleChain(NamedTuple):
    """A chain to become a sample: where it is stored, its leaf, the hash it must have."""

    key: str
    leaf_call_id: str
    cumulative_hash: str


class SampleOutcome(BaseModel):
    """One chain of a multi-sample rollout, as the finalized event reports it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    sample_key: SampleKey
    leaf_call_id: CallId
    status: Literal["accepted", "rejected"]
    rejection_reason: RejectionCode | None = None
    prompt_len: Count = 0
    total_len: Count = 0
    generated_tokens: Count = 0
    call_count: Count = 0
    min_weight_version: Count | None = None
    max_weight_version: Count | None = None

    @model_validator(mode="after")
    def _rules(self) -> SampleOutcome:
        if (self.status == "accepted") != (self.rejection_reason is None):
            raise ValueError("rejection_reason: required exactly when the sample is rejected")
        return self


class FinalizedEvent(EventRecord):
    """One per admitted rollout: accepted with a sample key, or rejected with a code."""

    rollout_id: RolloutId
    group_id: Label | None = None
    status: Literal["accepted", "rejected"]
    rejection_reason: RejectionCode | None = None
    sample_key: SampleKey | None = None
    prompt_len: Count
    total_len: Count
    generated_tokens: Count
    call_count: Count
    min_weight_version: Count | None = None
    max_weight_version: Count | None = None
    reward: float | None = None
    finalized_at: Timestamp
    sample_policy: SamplePolicy = added_in_4("terminal")
    samples: list[SampleOutcome] = added_in_4([])
    """Under a multi-sample policy, every chain's outcome; the lengths and versions above
    then sum (or bound) those of the accepted samples."""

    @model_validator(mode="after")
    def _rules(self) -> FinalizedEvent:
        if self.status == "rejected" and self.rejection_reason is None:
            raise ValueError("rejection_reason: required for a rejected rollout")
        if self.status == "accepted" and self.rejection_reason is not None:
            raise ValueError("rejection_reason: an accepted rollout has none")
        if self.sample_policy == "terminal":
            if self.samples:
                raise ValueError("samples: only a leaves or chains policy lists samples")
            if self.status == "accepted" and self.sample_key is None:
                raise ValueError("sample_key: required for an accepted rollout")
            return self
        if self.sample_key is not None:
            raise ValueError("sample_key: a multi-sample rollout names its samples in samples")
        accepted = any(outcome.status == "accepted" for outcome in self.samples)
        if accepted != (self.status == "accepted"):
            raise ValueError("status: accepted exactly when one of its samples is")
        return self

    @property
    def sample_keys(self) -> list[str]:
        """The data-plane keys of this rollout's accepted samples, in chain order."""
        if self.sample_policy == "terminal":
            return [self.sample_key] if self.status == "accepted" and self.sample_key else []
        return [outcome.sample_key for outcome in self.samples if outcome.status == "accepted"]


class CallSpan(RowRecord):
    """Where one call of the terminal chain lies in the linearized sample."""

    call_id: CallId
    start: Count
    carry_len: Count
    gen_len: Annotated[int, Field(ge=1)]
    reward: FiniteFloat | None = None
    """The reward the seal gave this call (``call_rewards``), credited to the last token of
    its span; None: none given. Stored only when given, so other samples stay as they were."""
    sampling: SamplingProvenance | None = None
    """The options the call was sampled with (``topics.sampling``); None: unknown (captured
    before provenance was recorded). Stored only when given, like ``reward``."""


class TrainingSample(RowRecord):
    """The finalized sample, stored in the data plane under the rollout id."""

    rollout_id: RolloutId
    group_id: Label | None = None
    token_ids: list[TokenId]
    token_mask: list[float]
    logprobs: list[float]
    weight_versions: list[Count]
    spans: list[CallSpan]
    reward: float | None = None
    cumulative_hash: Sha256Hex
    sample_key: SampleKey | None = None
    """Where the sample is stored when it is one of several; None: under the rollout id."""

    @property
    def key(self) -> str:
        return self.sample_key or self.rollout_id

    @property
    def unreplayable(self) -> bool:
        """Whether a call of the sample applied an option no trainer can replay (§4.7)."""
        return any(span.sampling is not None and span.sampling.unreplayable for span in self.spans)

    @model_validator(mode="after")
    def _rules(self) -> TrainingSample:
        n = len(self.token_ids)
        for name in ("token_mask", "logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: length {len(getattr(self, name))} != {n} token ids")
        end = 0
        for span in self.spans:
            if span.start != end:
                raise ValueError(f"spans: call {span.call_id} starts at {span.start}, expected {end}")
            end = span.start + span.carry_len + span.gen_len
        if end != n:
            raise ValueError(f"spans: cover {end} tokens, sample has {n}")
        return self


class DeadLetter(EventRecord):
    """An input a stage could not use, kept whole with the reason it was refused.

    ``value_b64`` is the raw value; only when the letter would exceed the event size
    limit does it hold just the value's first bytes, with ``value_truncated_from`` the
    full size (the whole record stays at its source offset).
    """

    source_topic: str
    source_partition: Count
    source_offset: Count
    reason: str
    field: str | None = None
    key: str | None = None
    headers: dict[str, str]
    value_b64: str
    value_truncated_from: Count | None = None
    stage: Label
