"""A row's ``meta`` document (UTF-8 JSON: identity, hashes, extras or spans) and the
record a row decodes to, shared by every row layout.

Decoding builds records with ``assemble`` (the record ``model_construct`` builds, for
less) from correctly typed Python values and does *not* re-run the §4.2 rules, so a
verifier downstream can map each corruption to its own failure code. What it checks is
structure: a ``meta`` document with the expected keys and JSON types, four counts on a
call. A row that fails is reported by ``RowFormatError`` naming the key and the field.
"""

from __future__ import annotations

from typing import Any

import orjson

from pipeline.dataplane.packed import RowFormatError
from topics import canonical
from topics.records import CallSpan, StagedCall, TrainingSample, assemble
from topics.sampling import SamplingProvenance
from topics.staging import CallRow

COUNTS: tuple[str, ...] = ("prev_len", "delta_len", "cum_len", "weight_version")
CALL_PARTS: tuple[str, ...] = ("counts", "token_ids", "token_mask", "logprobs", "meta")
SAMPLE_PARTS: tuple[str, ...] = ("token_ids", "weight_versions", "token_mask", "logprobs", "meta")
"""A row's parts in the order every layout hands them to ``call_record`` / ``sample_record``:
the vectors (lists), then ``meta`` (bytes)."""

_STR = (str,)
_OPT_STR = (str, type(None))


# ---------------------------------------------------------------- writing


def call_meta(row: CallRow) -> bytes:
    """A call row's ``meta`` document; only canonical extras survive JSON unchanged."""
    key = row.staging_key
    try:
        canonical.extras(row.extras)
    except canonical.EncodingError as exc:
        raise RowFormatError(key, "extras", str(exc)) from None
    return _dumps(
        key,
        {
            "schema_version": row.schema_version,
            "rollout_id": row.rollout_id,
            "call_id": row.call_id,
            "parent_call_id": row.parent_call_id,
            "mode": row.mode,
            "extras": row.extras,
            "extras_digest": row.extras_digest,
            "chain_hash": row.chain_hash,
            "cumulative_hash": row.cumulative_hash,
            "digest": row.digest,
        },
    )


def sample_meta(sample: TrainingSample) -> bytes:
    return _dumps(
        sample.key,
        {
            "schema_version": sample.schema_version,
            "rollout_id": sample.rollout_id,
            "group_id": sample.group_id,
            "reward": sample.reward,
            "cumulative_hash": sample.cumulative_hash,
            "spans": [
                {
                    "call_id": span.call_id,
                    "start": span.start,
                    "carry_len": span.carry_len,
                    "gen_len": span.gen_len,
                    **({"reward": span.reward} if span.reward is not None else {}),
                    **({"sampling": span.sampling.extras()} if span.sampling is not None else {}),
                }
                for span in sample.spans
            ],
            # Only a sample that is one of several has its own key: the others stay
            # byte for byte what older readers know.
            **({"sample_key": sample.sample_key} if sample.sample_key is not None else {}),
        },
    )


def _dumps(key: str, document: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(document)
    except TypeError as exc:
        raise RowFormatError(key, "meta", f"not JSON-encodable ({exc})") from None


# ---------------------------------------------------------------- reading


def call_record(
    key: str, counts: list[Any], token_ids: list[Any], token_mask: list[Any], logprobs: list[Any], meta: bytes
) -> StagedCall:
    """The ``StagedCall`` a row's parts say (in ``CALL_PARTS`` order), unvalidated."""
    if len(counts) != len(COUNTS):
        raise RowFormatError(
            key, "counts", f"{len(counts)} values, expected {len(COUNTS)} ({', '.join(COUNTS)})"
        )
    document = _document(key, meta)
    return assemble(
        StagedCall,
        {
            "schema_version": _take(key, document, "schema_version", (int,)),
            "rollout_id": _take(key, document, "rollout_id", _STR),
            "call_id": _take(key, document, "call_id", _STR),
            "parent_call_id": _take(key, document, "parent_call_id", _OPT_STR),
            "mode": _take(key, document, "mode", _STR),
            "prev_len": counts[0],
            "delta_len": counts[1],
            "cum_len": counts[2],
            "weight_version": counts[3],
            "token_ids_delta": token_ids,
            "token_mask_delta": token_mask,
            "logprobs_delta": logprobs,
            "extras": _take(key, document, "extras", (dict, type(None))),
            "extras_digest": _take(key, document, "extras_digest", _STR),
            "chain_hash": _take(key, document, "chain_hash", _STR),
            "cumulative_hash": _take(key, document, "cumulative_hash", _STR),
            "digest": _take(key, document, "digest", _STR),
        },
    )


def sample_record(
    key: str,
    token_ids: list[Any],
    weight_versions: list[Any],
    token_mask: list[Any],
    logprobs: list[Any],
    meta: bytes,
) -> TrainingSample:
    """The ``TrainingSample`` a row's parts say (in ``SAMPLE_PARTS`` order), unvalidated."""
    document = _document(key, meta)
    schema_version = _take(key, document, "schema_version", (int,))
    return assemble(
        TrainingSample,
        {
            "schema_version": schema_version,
            "rollout_id": _take(key, document, "rollout_id", _STR),
            "group_id": _take(key, document, "group_id", _OPT_STR),
            "token_ids": token_ids,
            "token_mask": token_mask,
            "logprobs": logprobs,
            "weight_versions": weight_versions,
            "spans": _spans(key, _take(key, document, "spans", (list,)), schema_version),
            "reward": _take(key, document, "reward", (float, type(None))),
            "cumulative_hash": _take(key, document, "cumulative_hash", _STR),
            "sample_key": _take(key, document, "sample_key", _STR) if "sample_key" in document else None,
        },
    )


def _document(key: str, blob: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(blob)
    except orjson.JSONDecodeError as exc:
        raise RowFormatError(key, "meta", f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise RowFormatError(key, "meta", f"expected a JSON object, got {type(document).__name__}")
    return document


def _take(key: str, document: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    """``document[name]`` if present with one of ``types`` (bool is not an int here)."""
    if name not in document:
        raise RowFormatError(key, f"meta.{name}", "missing")
    value = document[name]
    if type(value) not in types:
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise RowFormatError(key, f"meta.{name}", f"expected {wanted}, got {type(value).__name__}")
    return value


def _sampling(key: str, j: int, item: dict[str, Any]) -> SamplingProvenance | None:
    if "sampling" not in item:
        return None
    try:
        return SamplingProvenance.model_validate(item["sampling"])
    except ValueError as exc:
        raise RowFormatError(key, f"meta.spans[{j}].sampling", str(exc)) from None


def _spans(key: str, raw: list[Any], schema_version: Any) -> list[CallSpan]:
    spans: list[CallSpan] = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RowFormatError(key, f"meta.spans[{j}]", f"expected an object, got {type(item).__name__}")
        spans.append(
            assemble(
                CallSpan,
                {
                    "schema_version": schema_version,
                    "call_id": _take(key, item, "call_id", _STR),
                    "start": _take(key, item, "start", (int,)),
                    "carry_len": _take(key, item, "carry_len", (int,)),
                    "gen_len": _take(key, item, "gen_len", (int,)),
                    "reward": _take(key, item, "reward", (float, int)) if "reward" in item else None,
                    "sampling": _sampling(key, j, item),
                },
            )
        )
    return spans
