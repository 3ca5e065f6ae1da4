"""Digests of DESIGN §4.3: golden vectors, an independent reference encoder, sensitivity."""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from topics import canonical, digest
from topics.canonical import EncodingError
from topics.staging import build_row, staging_row

# --- an independent, loop-based reference of the byte layout --------------------------


def ref_u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def ref_text(s: str) -> bytes:
    b = s.encode()
    return ref_u64(len(b)) + b


def ref_ids(v: list[int]) -> bytes:
    return ref_u64(len(v)) + b"".join(struct.pack(">Q", x) for x in v)


def ref_f32s(v: list[float]) -> bytes:
    return ref_u64(len(v)) + b"".join(struct.pack(">f", x) for x in v)


def ref_extras(x: Any) -> bytes:
    if x is None:
        return b"N"
    if isinstance(x, bool):
        return b"B" + bytes([int(x)])
    if isinstance(x, int):
        return b"I" + struct.pack(">q", x)
    if isinstance(x, float):
        return b"F" + struct.pack(">d", x)
    if isinstance(x, str):
        return b"S" + ref_text(x)
    if isinstance(x, list):
        return b"L" + ref_u64(len(x)) + b"".join(ref_extras(i) for i in x)
    assert isinstance(x, dict)
    keys = sorted(x, key=lambda k: k.encode())
    return b"D" + ref_u64(len(x)) + b"".join(ref_text(k) + ref_extras(x[k]) for k in keys)


def ref_call_digest(f: dict[str, Any]) -> str:
    parent = f["parent_call_id"]
    payload = (
        b"nemo-gym-staging-call-v2"
        + bytes([3, 2, 1])
        + ref_text(f["rollout_id"])
        + ref_text(f["call_id"])
        + (b"\x00" if parent is None else b"\x01" + ref_text(parent))
        + ref_text(f["mode"])
        + b"".join(ref_u64(f[k]) for k in ("prev_len", "delta_len", "cum_len", "weight_version"))
    )
    for blob in (
        ref_ids(f["token_ids_delta"]),
        ref_f32s(f["token_mask_delta"]),
        ref_f32s(f["logprobs_delta"]),
    ):
        payload += ref_u64(len(blob)) + blob
    payload += bytes.fromhex(f["extras_digest"])
    payload += b"\x01" + bytes.fromhex(f["chain_hash"]) + b"\x01" + bytes.fromhex(f["cumulative_hash"])
    return hashlib.sha256(payload).hexdigest()


# --- golden rows ---------------------------------------------------------------------------

ROOT_PROMPT = [11, 12, 13, 14, 15]
ROOT_GEN = [21, 22]
CHILD_NEW = [31, 32, 33]
CHILD_GEN = [41, 42, 43]
EXTRAS = {"policy_epochs": [[0, 0], [2, 1]], "engine": "vllm", "ratio": 0.5, "ok": True, "none": None}


def root_row():  # type: ignore[no-untyped-def]
    delta = digest.build_delta(ROOT_PROMPT, ROOT_GEN, [-0.5, -0.25], 0)
    return staging_row(
        rollout_id="r-1",
        call_id="c1",
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=delta,
        weight_version=0,
    )


def child_row(extras: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
    root = root_row()
    prefix = root.token_ids_delta
    delta = digest.build_delta([*prefix, *CHILD_NEW], CHILD_GEN, [-1.0, -0.125, -2.0], len(prefix))
    return staging_row(
        rollout_id="r-1",
        call_id="c2",
        parent_call_id="c1",
        parent_chain_hash=root.chain_hash,
        prefix_ids=prefix,
        delta=delta,
        weight_version=3,
        extras=extras,
    )


GOLDEN = {
    "root": {
        "extras_digest": "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6",
        "chain_hash": "aa784418f87095bc65f3294b00fd25c8563833dde3966d261ee0673700fedaf7",
        "cumulative_hash": "fc207d11c0e65adcd66d55d3ea751fd873ab83d517aa3f684527eb015f47629b",
        "digest": "7bd0333e010795b8cc0728816fd70c2b79966923bb7f09645050384ce46e8368",
    },
    "child": {
        "chain_hash": "e5a7fec2689bba29e6e7414d3ce07bf3547bc65dc9e32d5380cbcfa907405be3",
        "cumulative_hash": "45919a2b3ee41fe98aa23fde6f72e3ea54e02d77993b80f560e6b6ae144d3131",
        "digest": "6d676a6000d192a74e61f96ecc3ecbad6958312293b79205b9a54f6a7eb664f8",
    },
    "child_extras": {
        "extras_digest": "fd72c7ecc42c3d43d44c14fd18e364be1570d08b95bf244357a78a5431551876",
        "digest": "13ec801d1485bca10ac5211aac849f191b70758b6e5469edff4550198ccf25f4",
    },
}


@pytest.mark.parametrize("name", ["root", "child", "child_extras"])
def test_golden_vectors(name: str) -> None:
    row = {"root": root_row, "child": child_row, "child_extras": lambda: child_row(EXTRAS)}[name]()
    for field, expected in GOLDEN[name].items():
        assert getattr(row, field) == expected, field


@pytest.mark.parametrize("extras", [None, EXTRAS])
def test_matches_independent_reference(extras: dict[str, Any] | None) -> None:
    for row in (root_row(), child_row(extras)):
        fields = row.model_dump()
        assert (
            row.extras_digest
            == hashlib.sha256(b"nemo-gym-staging-extras-v1" + b"\x01" + ref_extras(row.extras)).hexdigest()
        )
        assert row.digest == ref_call_digest(fields)
    root, child = root_row(), child_row(extras)
    assert (
        root.chain_hash
        == hashlib.sha256(b"nemo-gym-staging-chain-v1" + b"\x00" + ref_ids(root.token_ids_delta)).hexdigest()
    )
    assert (
        child.chain_hash
        == hashlib.sha256(
            b"nemo-gym-staging-chain-v1"
            + b"\x01"
            + bytes.fromhex(root.chain_hash)
            + ref_ids(child.token_ids_delta)
        ).hexdigest()
    )
    assert (
        child.cumulative_hash
        == hashlib.sha256(
            b"nemo-gym-staging-prefix-v2" + ref_ids(root.token_ids_delta + child.token_ids_delta)
        ).hexdigest()
    )


def test_root_delta_shape() -> None:
    row = root_row()
    assert row.token_ids_delta == ROOT_PROMPT + ROOT_GEN
    assert row.token_mask_delta == [0.0] * 5 + [1.0] * 2
    assert row.logprobs_delta == [0.0] * 5 + [-0.5, -0.25]
    assert (row.prev_len, row.delta_len, row.cum_len) == (0, 7, 7)


def test_child_delta_shape() -> None:
    row = child_row()
    assert row.token_ids_delta == CHILD_NEW + CHILD_GEN
    assert (row.prev_len, row.delta_len, row.cum_len) == (7, 6, 13)
    assert row.mode == "token_in"


# Each field, changed alone, must change the call digest.
FIELD_CHANGES: dict[str, Any] = {
    "rollout_id": "r-2",
    "call_id": "c3",
    "parent_call_id": "c0",
    "prev_len": 8,
    "weight_version": 4,
    "extras_digest": "0" * 64,
    "chain_hash": "1" * 64,
    "cumulative_hash": "2" * 64,
}


@pytest.mark.parametrize("field", [*FIELD_CHANGES, "token_id", "mask", "logprob", "mode_len"])
def test_any_field_changes_digest(field: str) -> None:
    base = child_row().model_dump()
    del base["digest"]
    before = digest.call_digest(base)
    changed = dict(base)
    if field in FIELD_CHANGES:
        changed[field] = FIELD_CHANGES[field]
        if field == "prev_len":
            changed["cum_len"] = changed["prev_len"] + changed["delta_len"]
    elif field == "token_id":
        changed["token_ids_delta"] = [*base["token_ids_delta"][:-1], base["token_ids_delta"][-1] + 1]
    elif field == "mask":
        changed["token_mask_delta"] = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        changed["logprobs_delta"] = [0.0, 0.0, 0.0, 0.0, -0.125, -2.0]
    elif field == "logprob":
        changed["logprobs_delta"] = [*base["logprobs_delta"][:-1], -2.5]
    else:  # one more carried token changes delta_len and cum_len together
        changed["token_ids_delta"] = [30, *base["token_ids_delta"]]
        changed["token_mask_delta"] = [0.0, *base["token_mask_delta"]]
        changed["logprobs_delta"] = [0.0, *base["logprobs_delta"]]
        changed["delta_len"] += 1
        changed["cum_len"] += 1
    assert digest.call_digest(changed) != before


def test_text_and_token_in_modes_hash_differently() -> None:
    row = root_row().model_dump()
    del row["digest"]
    assert digest.call_digest(row) != digest.call_digest(
        {**row, "mode": "token_in", "parent_call_id": "p", "prev_len": 1, "cum_len": row["cum_len"] + 1}
    )


def test_call_digest_checks_rules() -> None:
    row = child_row().model_dump()
    del row["digest"]
    with pytest.raises(digest.InvalidDelta, match="cum_len"):
        digest.call_digest({**row, "cum_len": 99})


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ((1, 2), "tuple"),
        (np.float64(1.0), "float64"),
        (b"x", "bytes"),
        (float("nan"), "finite"),
        ({1: "a"}, "keys must be str"),
        (2**63, "i64"),
        ({"a": [np.int64(1)]}, "extras.a\\[0\\]"),
    ],
)
def test_extras_rejects_non_json_like(extras: Any, message: str) -> None:
    with pytest.raises(EncodingError, match=message):
        digest.extras_digest(extras)


def test_extras_keys_sorted_by_utf8_bytes() -> None:
    a = {"é": 1, "z": 2, "A": 3}
    assert digest.extras_digest(a) == digest.extras_digest(dict(reversed(list(a.items()))))
    assert digest.extras_digest({"a": 1}) != digest.extras_digest({"a": 1.0})
    assert digest.extras_digest({"a": True}) != digest.extras_digest({"a": 1})


@given(st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=300))
def test_ids_encoding_matches_reference(ids: list[int]) -> None:
    assert (
        digest.cumulative_hash(ids)
        == hashlib.sha256(b"nemo-gym-staging-prefix-v2" + ref_ids(ids)).hexdigest()
    )
    assert digest.cumulative_hash(np.asarray(ids, dtype=np.int64)) == digest.cumulative_hash(ids)


@given(
    st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=100),
    st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=100),
)
def test_cumulative_hash_of_parts_is_the_hash_of_the_joined_ids(prefix: list[int], delta: list[int]) -> None:
    parts = (canonical.ids_array(prefix), canonical.ids_array(delta))
    assert digest.cumulative_hash_of_parts(*parts) == digest.cumulative_hash(prefix + delta)


@given(st.lists(st.floats(-1e6, 0.0, width=32), min_size=1, max_size=60), st.integers(0, 30))
def test_digest_of_canonical_equals_digest_of_row(logprobs: list[float], carry: int) -> None:
    prompt = list(range(100, 100 + carry + 3))
    delta = digest.build_delta(prompt, list(range(len(logprobs))), logprobs, 3)
    row = build_row(
        rollout_id="r",
        call_id="c",
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=delta,
        weight_version=2,
    )
    assert row.digest == digest.digest_of_row(row, delta.token_ids, delta.token_mask, delta.logprobs)
    assert row.digest == digest.call_digest(row.record().model_dump(exclude={"digest"}))


@pytest.mark.parametrize(
    ("value", "accepted"),
    [(float(np.finfo(np.float32).max), True), (-3.5e38, False), (1e39, False), (-math.inf, False)],
)
def test_build_delta_bounds_logprobs_to_float32(value: float, accepted: bool) -> None:
    if accepted:
        assert digest.build_delta([1], [3], [value], 0).logprobs[-1] == np.float32(value)
        return
    with pytest.raises(digest.InvalidDelta, match="finite in float32") as info:
        digest.build_delta([1], [3], [value], 0)
    assert info.value.field == "generated_logprobs"


@pytest.mark.parametrize("bad", [[1, -1], [1.5], [1, 2.0], ["3"]])
def test_ids_reject_non_token_values(bad: list[Any]) -> None:
    with pytest.raises(EncodingError, match="token_ids"):
        digest.cumulative_hash(bad)
    with pytest.raises(EncodingError):
        digest.cumulative_hash(np.asarray(bad) if not isinstance(bad[0], str) else bad)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=50))
def test_build_delta_keeps_float32_logprobs(logprobs: list[float]) -> None:
    gen = list(range(len(logprobs)))
    delta = digest.build_delta([5, 6], gen, logprobs, 1)
    assert delta.logprobs[delta.carry_len :].tolist() == logprobs
    assert delta.carry_len == 1 and delta.gen_len == len(gen)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([1, 2], [], [], 0), "generated_ids"),
        (([1, 2], [3], [-0.1, -0.2], 0), "generated_logprobs"),
        (([1, 2], [3], [math.nan], 0), "generated_logprobs"),
        (([1, 2], [3], [math.inf], 0), "generated_logprobs"),
        (([1], [3], [-0.1], 2), "prompt_ids"),
        (([1], [3], [-0.1], -1), "prev_len"),
        (([1, -2], [3], [-0.1], 0), "prompt_ids"),
        (([1], [3.0], [-0.1], 0), "generated_ids"),
    ],
)
def test_build_delta_rejects(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises((digest.InvalidDelta, EncodingError)) as info:
        digest.build_delta(*args)
    assert info.value.field == field  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rollout_id": "bad id"}, "rollout_id"),
        ({"call_id": "-c"}, "call_id"),
        ({"weight_version": -1}, "weight_version"),
        ({"parent_call_id": "p"}, "parent_call_id"),
        ({"extras": {"weight_version_spans": [[1, 2]]}}, "weight_version_spans"),
    ],
)
def test_stage_row_checks_its_scalar_fields(changes: dict[str, Any], field: str) -> None:
    delta = digest.build_delta([1, 2], [3, 4], [-0.5, -0.25], 0)
    args: dict[str, Any] = {
        "rollout_id": "r",
        "call_id": "c",
        "parent_call_id": None,
        "parent_chain_hash": None,
        "prefix_ids": [],
        "delta": delta,
        "weight_version": 0,
        **changes,
    }
    with pytest.raises(ValueError, match=field):
        staging_row(**args)


def test_stage_row_output_passes_full_validation() -> None:
    from topics.records import StagedCall

    row = child_row(EXTRAS)
    assert StagedCall.model_validate(row.model_dump()) == row
