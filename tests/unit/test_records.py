"""Every invariant of DESIGN §4.2 is rejected with an error that names the field."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from topics import digest
from topics.codec import encode_payload
from topics.records import (
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    FinalizedEvent,
    ManifestEntry,
    RolloutReceipt,
    RolloutSeal,
    StagedCall,
    TrainingSample,
    assemble,
)
from topics.staging import staging_row

HASH = "ab" * 32


def admission(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout_id": "r1",
        "call_id": "c2",
        "parent_call_id": "c1",
        "prev_len": 7,
        "mode": "token_in",
        "staging_chain": ["r1/c1"],
        "parent_chain_hash": HASH,
        "admitted_at": 1.0,
    }
    base.update(changes)
    return base


def row(**changes: Any) -> dict[str, Any]:
    delta = digest.build_delta([1, 2, 3], [7, 8], [-0.5, -0.25], 0)
    base = staging_row(
        rollout_id="r1",
        call_id="c1",
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=delta,
        weight_version=0,
    ).model_dump()
    base.update(changes)
    return base


def rejects(model: type, data: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    assert field in str(info.value), str(info.value)


def test_valid_admissions() -> None:
    CaptureAdmission.model_validate(admission())
    CaptureAdmission.model_validate(
        admission(parent_call_id=None, prev_len=0, mode="text", staging_chain=None, parent_chain_hash=None)
    )


def test_text_mode_with_parent() -> None:
    rejects(
        CaptureAdmission,
        admission(mode="text", prev_len=0, staging_chain=None, parent_chain_hash=None),
        "parent_call_id",
    )


def test_token_in_without_chain_hash() -> None:
    rejects(CaptureAdmission, admission(parent_chain_hash=None), "parent_chain_hash")


def test_token_in_without_chain() -> None:
    rejects(CaptureAdmission, admission(staging_chain=None), "staging_chain")


def test_token_in_without_prev_len() -> None:
    rejects(CaptureAdmission, admission(prev_len=0), "prev_len")


def test_empty_list_standing_in_for_absent_prefix() -> None:
    rejects(
        CaptureAdmission,
        admission(parent_call_id=None, prev_len=0, mode="text", staging_chain=[], parent_chain_hash=None),
        "staging_chain",
    )


def test_chain_must_end_with_parent() -> None:
    rejects(CaptureAdmission, admission(staging_chain=["r1/c0"]), "staging_chain")


def test_chain_key_of_other_rollout() -> None:
    rejects(CaptureAdmission, admission(staging_chain=["r9/c0", "r1/c1"]), "staging_chain")


def test_cyclic_chain() -> None:
    rejects(CaptureAdmission, admission(staging_chain=["r1/c2", "r1/c1"]), "staging_chain")


@pytest.mark.parametrize("bad", ["", "-r", "r/1", "r 1", "r:1", "é"])
def test_bad_rollout_id_characters(bad: str) -> None:
    rejects(CaptureAdmission, admission(rollout_id=bad), "rollout_id")


def test_unknown_field() -> None:
    rejects(CaptureAdmission, admission(surprise=1), "surprise")


def test_unknown_schema_version() -> None:
    rejects(CaptureAdmission, admission(schema_version=5), "schema_version")
    rejects(CaptureAdmission, admission(schema_version=2), "schema_version")
    rejects(StagedCall, {**row(), "schema_version": 4}, "schema_version")  # rows stay schema 3


def test_a_schema_3_event_is_read_into_the_schema_4_record() -> None:
    assert CaptureAdmission.model_validate(admission(schema_version=3)).schema_version == 4


def test_strict_types_no_coercion() -> None:
    rejects(CaptureAdmission, admission(prev_len="7"), "prev_len")


def test_valid_row() -> None:
    StagedCall.model_validate(row())


def test_prev_len_cum_len_mismatch() -> None:
    rejects(StagedCall, row(cum_len=6), "cum_len")


def test_delta_len_mismatch() -> None:
    rejects(StagedCall, row(delta_len=4, cum_len=4), "token_ids_delta")


def test_mask_not_zeros_then_ones() -> None:
    rejects(
        StagedCall,
        row(token_mask_delta=[0.0, 1.0, 0.0, 1.0, 1.0], logprobs_delta=[0.0, -1.0, 0.0, -1.0, -1.0]),
        "token_mask_delta",
    )


def test_mask_values_other_than_zero_one() -> None:
    rejects(StagedCall, row(token_mask_delta=[0.0, 0.0, 0.0, 0.5, 1.0]), "token_mask_delta")


def test_nonzero_logprob_under_mask_zero() -> None:
    rejects(StagedCall, row(logprobs_delta=[0.0, -0.1, 0.0, -0.5, -0.25]), "logprobs_delta")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_logprob(value: float) -> None:
    rejects(StagedCall, row(logprobs_delta=[0.0, 0.0, 0.0, value, -0.25]), "logprobs_delta")


@pytest.mark.parametrize("value", [-1, 1.0, True, "1"])
def test_negative_or_non_int_token_id(value: Any) -> None:
    rejects(StagedCall, row(token_ids_delta=[value, 2, 3, 7, 8]), "token_ids_delta")


def test_empty_generation() -> None:
    rejects(StagedCall, row(token_mask_delta=[0.0] * 5, logprobs_delta=[0.0] * 5), "token_mask_delta")


def test_empty_delta() -> None:
    rejects(
        StagedCall,
        row(token_ids_delta=[], token_mask_delta=[], logprobs_delta=[], delta_len=0, cum_len=0),
        "delta_len",
    )


def test_row_text_mode_with_parent() -> None:
    rejects(StagedCall, row(parent_call_id="c0"), "parent_call_id")


def test_row_bad_hash() -> None:
    rejects(StagedCall, row(digest="XYZ"), "digest")


def test_row_extras_not_json_like() -> None:
    rejects(StagedCall, row(extras={"a": float("nan")}), "extras")


def coords(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout_id": "r1",
        "call_id": "c1",
        "mode": "text",
        "prev_len": 0,
        "delta_len": 5,
        "cum_len": 5,
        "weight_version": 0,
        "staging_key": "r1/c1",
        "staging_chain": ["r1/c1"],
        "chain_hash": HASH,
        "cumulative_hash": HASH,
        "digest": HASH,
        "extras_digest": HASH,
        "disposition": "staged",
    }
    base.update(changes)
    return base


def test_coords_rules() -> None:
    CommitCoords.model_validate(coords())
    CommitCoords.model_validate(
        coords(
            disposition="capture_failed",
            failure_reason="prefix_unavailable",
            chain_hash=None,
            delta_len=0,
            cum_len=0,
        )
    )
    rejects(CommitCoords, coords(staging_key="r1/c2"), "staging_key")
    rejects(CommitCoords, coords(staging_chain=["r1/c0"]), "staging_chain")
    rejects(CommitCoords, coords(digest=None), "digest")
    rejects(CommitCoords, coords(disposition="capture_failed"), "failure_reason")
    rejects(CommitCoords, coords(failure_reason="prefix_unavailable"), "failure_reason")
    rejects(CommitCoords, coords(disposition="capture_failed", failure_reason="not_a_code"), "failure_reason")


def test_seal_rules() -> None:
    seal = {"rollout_id": "r1", "status": "completed", "sealed_at": 2.0}
    RolloutSeal.model_validate(seal)
    rejects(RolloutSeal, {**seal, "status": "failed"}, "failure_reason")
    rejects(RolloutSeal, {**seal, "terminal_call_id": "c1", "terminal_response_id": "x"}, "terminal_call_id")
    rejects(RolloutSeal, {**seal, "reward": math.inf}, "reward")
    rejects(RolloutSeal, {**seal, "call_rewards": {"c1": math.inf}}, "call_rewards")
    rejects(RolloutSeal, {**seal, "sample_policy": "every"}, "sample_policy")
    rejects(RolloutSeal, {**seal, "terminal_call_id": "c1", "sample_policy": "leaves"}, "sample_policy")


def test_fields_added_to_schema_4_are_written_only_when_used() -> None:
    """A seal, receipt or finalized event of the terminal policy keeps its old bytes."""
    seal = RolloutSeal(rollout_id="r1", status="completed", sealed_at=2.0)
    assert b"sample_policy" not in encode_payload(seal) and b"all_or_nothing" not in encode_payload(seal)
    leaves = seal.model_copy(update={"sample_policy": "leaves", "all_or_nothing": False})
    written = orjson.loads(encode_payload(leaves))
    assert (written["sample_policy"], written["all_or_nothing"]) == ("leaves", False)
    assert RolloutSeal.model_validate_json(encode_payload(leaves)) == leaves
    assert b"call_rewards" not in encode_payload(seal)
    turns = seal.model_copy(update={"call_rewards": {"c1": 0.5}})
    assert RolloutSeal.model_validate_json(encode_payload(turns)).call_rewards == {"c1": 0.5}


def test_receipt_rules() -> None:
    base = {
        "rollout_id": "r1",
        "manifest": [],
        "failed_calls": [],
        "capture_poisoned": False,
        "sealed_at": 1.0,
    }
    rejects(RolloutReceipt, base, "terminal_call_id")
    RolloutReceipt.model_validate({**base, "capture_poisoned": True, "failure_reason": "no_calls"})
    rejects(RolloutReceipt, {**base, "capture_poisoned": True}, "failure_reason")
    ok = {"leaf_call_id": "c1", "cumulative_hash": "a" * 64}
    failed = {"leaf_call_id": "c2", "failure_reason": "staging_timeout"}
    entry = {
        "call_id": "c1",
        "mode": "text",
        "prev_len": 0,
        "delta_len": 2,
        "chain_hash": "b" * 64,
        "digest": "c" * 64,
    }
    multi = {**base, "sample_policy": "leaves", "manifest": [entry], "chains": [ok, failed]}
    RolloutReceipt.model_validate(multi)
    rejects(RolloutReceipt, {**multi, "chains": [ok, ok]}, "chains")
    rejects(RolloutReceipt, {**multi, "chains": [{**ok, "leaf_call_id": "c9"}]}, "chains")
    rejects(RolloutReceipt, {**multi, "chains": [{**ok, **failed}]}, "cumulative_hash")
    rejects(RolloutReceipt, {**multi, "chains": [failed]}, "capture_poisoned")
    rejects(RolloutReceipt, {**multi, "terminal_call_id": "c1"}, "terminal_call_id")
    rejects(RolloutReceipt, {**base, "chains": [ok]}, "chains")
    RolloutReceipt.model_validate(
        {**multi, "chains": [failed], "capture_poisoned": True, "failure_reason": "staging_timeout"}
    )


def test_finalized_rules() -> None:
    base = {
        "rollout_id": "r1",
        "status": "accepted",
        "prompt_len": 1,
        "total_len": 3,
        "generated_tokens": 2,
        "call_count": 1,
        "finalized_at": 1.0,
    }
    rejects(FinalizedEvent, base, "sample_key")
    FinalizedEvent.model_validate({**base, "sample_key": "r1"})
    rejects(FinalizedEvent, {**base, "status": "rejected"}, "rejection_reason")
    FinalizedEvent.model_validate({**base, "status": "rejected", "rejection_reason": "digest_mismatch"})
    sample = {"sample_key": "r1@c1", "leaf_call_id": "c1", "status": "accepted"}
    bad = {
        "sample_key": "r1@c2",
        "leaf_call_id": "c2",
        "status": "rejected",
        "rejection_reason": "missing_row",
    }
    multi = {**base, "sample_policy": "leaves", "samples": [sample, bad]}
    assert FinalizedEvent.model_validate(multi).sample_keys == ["r1@c1"]
    rejects(FinalizedEvent, {**multi, "sample_key": "r1"}, "sample_key")
    rejects(FinalizedEvent, {**multi, "samples": [bad]}, "status")
    rejects(FinalizedEvent, {**multi, "samples": [{**sample, "sample_key": "r1/c1"}]}, "sample_key")
    rejects(FinalizedEvent, {**multi, "samples": [{**bad, "rejection_reason": None}]}, "rejection_reason")
    rejects(FinalizedEvent, {**base, "sample_key": "r1", "samples": [sample]}, "samples")


def test_sample_spans_cover_tokens() -> None:
    base = {
        "rollout_id": "r1",
        "token_ids": [1, 2, 3],
        "token_mask": [0.0, 1.0, 1.0],
        "logprobs": [0.0, -1.0, -1.0],
        "weight_versions": [0, 0, 0],
        "cumulative_hash": HASH,
        "spans": [{"call_id": "c1", "start": 0, "carry_len": 1, "gen_len": 2}],
    }
    TrainingSample.model_validate(base)
    rejects(
        TrainingSample,
        {**base, "spans": [{"call_id": "c1", "start": 0, "carry_len": 1, "gen_len": 1}]},
        "spans",
    )
    rejects(TrainingSample, {**base, "weight_versions": [0]}, "weight_versions")


def test_assemble_builds_what_model_construct_builds() -> None:
    """``assemble`` skips pydantic's per-field walk; the record must be the same in every way."""
    staged = staging_row(
        rollout_id="r1",
        call_id="c0",
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=digest.build_delta([1, 2, 3], [7, 8], [-0.5, -0.25], 0),
        weight_version=1,
    )
    coords = {
        "rollout_id": "r1",
        "call_id": "c0",
        "mode": "text",
        "prev_len": 0,
        "delta_len": staged.delta_len,
        "cum_len": staged.cum_len,
        "weight_version": 1,
        "staging_key": "r1/c0",
        "chain_hash": staged.chain_hash,
        "cumulative_hash": staged.cumulative_hash,
        "digest": staged.digest,
        "extras_digest": staged.extras_digest,
        "disposition": "staged",
    }
    record = CallRecord.model_validate(
        {**coords, "admitted_at": 1.0, "staged_at": 2.0, "schema_version": 4}, strict=False
    )
    cases: list[tuple[type[BaseModel], BaseModel]] = [
        (CallRecord, record),
        (ManifestEntry, ManifestEntry.of(record)),
        (StagedCall, staged),
        (CommitCoords, CommitCoords.model_validate({**coords, "staging_chain": ["r1/c0"]}, strict=False)),
    ]
    for model, validated in cases:
        values = validated.model_dump()
        built = assemble(model, dict(values))
        constructed = model.model_construct(**values)
        assert built == constructed == validated
        assert built.model_fields_set == constructed.model_fields_set
        assert built.model_dump_json() == validated.model_dump_json()
        assert model.model_validate_json(built.model_dump_json()) == validated
        with pytest.raises(ValidationError):  # still frozen
            built.__setattr__(next(iter(values)), None)
        with pytest.raises(ValueError, match=r"missing fields \['call_id'\]"):
            assemble(model, {k: v for k, v in values.items() if k != "call_id"})
        with pytest.raises(ValueError, match=r"unknown fields \['surprise'\]"):
            assemble(model, {**values, "surprise": 1})
