"""Every record survives encode → decode; bad records fail with the field named."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topics import codec, digest
from topics.codec import DecodeError
from topics.events import EventType, envelope
from topics.names import TopicNames, topic_for
from topics.records import (
    MAX_CHAIN_DEPTH,
    CallCoords,
    CallRecord,
    CaptureAdmission,
    DeadLetter,
    FailedCall,
    FinalizedEvent,
    ManifestEntry,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedEvent,
    TrainingSample,
)
from topics.staging import staging_row

idents = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,15}\Z")
hashes = st.from_regex(r"\A[0-9a-f]{64}\Z")
times = st.floats(min_value=0, max_value=2e9, allow_nan=False)
finite = st.floats(allow_nan=False, allow_infinity=False)
counts = st.integers(min_value=0, max_value=2**40)
labels = st.text(min_size=1, max_size=20)


@st.composite
def admissions(draw: st.DrawFn) -> CaptureAdmission:
    rollout = draw(idents)
    call = draw(idents)
    root = draw(st.booleans())
    parent = draw(idents.filter(lambda p: p != call))
    return CaptureAdmission(
        rollout_id=rollout,
        call_id=call,
        admitted_at=draw(times),
        logical_call_id=draw(st.none() | labels),
        group_id=draw(st.none() | labels),
        **(
            {"mode": "text", "prev_len": 0}
            if root
            else {
                "mode": "token_in",
                "parent_call_id": parent,
                "prev_len": draw(st.integers(1, 10**6)),
                "staging_chain": [f"{rollout}/{parent}"],
                "parent_chain_hash": draw(hashes),
            }
        ),
    )


@st.composite
def coords_fields(draw: st.DrawFn) -> dict[str, Any]:
    rollout, call = draw(idents), draw(idents)
    delta = draw(st.integers(1, 10**5))
    return {
        "rollout_id": rollout,
        "call_id": call,
        "mode": "text",
        "prev_len": 0,
        "delta_len": delta,
        "cum_len": delta,
        "weight_version": draw(counts),
        "staging_key": f"{rollout}/{call}",
        "chain_hash": draw(hashes),
        "cumulative_hash": draw(hashes),
        "digest": draw(hashes),
        "extras_digest": draw(hashes),
        "disposition": "staged",
    }


@st.composite
def records(draw: st.DrawFn) -> Record:
    kind = draw(st.sampled_from(["admission", "seal", "staged", "call", "failed", "receipt", "final", "dlq"]))
    if kind == "admission":
        return draw(admissions())
    if kind == "seal":
        return RolloutSeal(
            rollout_id=draw(idents),
            group_id=draw(st.none() | labels),
            reward=draw(st.none() | finite),
            status="completed",
            sealed_at=draw(times),
            terminal_call_id=draw(st.none() | idents),
        )
    fields = draw(coords_fields())
    if kind == "staged":
        return StagedEvent(
            coords=CallCoords(**fields),
            worker_id=draw(labels),
            staged_at=draw(times),
            response_id=draw(st.none() | labels),
        )
    record = CallRecord(**fields, admitted_at=draw(times), staged_at=draw(times))
    if kind == "call":
        return record
    if kind == "failed":
        return FailedCall(
            rollout_id=fields["rollout_id"],
            call_id=fields["call_id"],
            reason="never_staged",
            detail=draw(st.none() | st.text(max_size=30)),
        )
    if kind == "receipt":
        return RolloutReceipt(
            rollout_id=fields["rollout_id"],
            manifest=[ManifestEntry.of(record)],
            failed_calls=[],
            terminal_call_id=record.call_id,
            terminal_selection="unique_leaf",
            terminal_cumulative_hash=record.cumulative_hash,
            capture_poisoned=False,
            sealed_at=draw(times),
            reward=draw(st.none() | finite),
        )
    if kind == "final":
        return FinalizedEvent(
            rollout_id=fields["rollout_id"],
            status="accepted",
            sample_key=fields["rollout_id"],
            prompt_len=draw(counts),
            total_len=draw(counts),
            generated_tokens=draw(counts),
            call_count=draw(counts),
            finalized_at=draw(times),
        )
    return DeadLetter(
        source_topic="t",
        source_partition=draw(counts),
        source_offset=draw(counts),
        reason=draw(st.text(max_size=30)),
        headers={"a": "b"},
        value_b64="",
        stage="ledger",
        key=fields["rollout_id"],
    )


@settings(max_examples=300)
@given(records())
def test_every_record_round_trips(record: Record) -> None:
    key, value, headers = codec.encode_record(record)
    event = codec.decode(key, value, headers)
    assert event.payload == record
    assert event.event_id == envelope(record).event_id
    assert topic_for(TopicNames(), event.event_type)


@settings(max_examples=300)
@given(records())
def test_payloads_are_the_bytes_orjson_writes(record: Record) -> None:
    """The ledger store writes ``encode_payload`` where it wrote orjson over ``model_dump``:
    a store written before still compares byte for byte with one written now."""
    assert codec.encode_payload(record) == orjson.dumps(record.model_dump())


@given(
    st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False, max_value=0.0), min_size=1, max_size=40
    )
)
def test_sample_round_trip(logprobs: list[float]) -> None:
    n = len(logprobs)
    sample = TrainingSample(
        rollout_id="r",
        token_ids=list(range(n)),
        token_mask=[1.0] * n,
        logprobs=logprobs,
        weight_versions=[0] * n,
        cumulative_hash=digest.cumulative_hash(list(range(n))),
        spans=[{"call_id": "c", "start": 0, "carry_len": 0, "gen_len": n}],
    )  # type: ignore[list-item]
    assert TrainingSample.model_validate(orjson.loads(codec.encode_payload(sample))) == sample


def test_staged_call_round_trips_through_json() -> None:
    delta = digest.build_delta([1, 2], [3], [-0.3], 0)
    row = staging_row(
        rollout_id="r",
        call_id="c",
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=delta,
        weight_version=1,
        extras={"x": [1, 2.5, None]},
    )
    again = type(row).model_validate(orjson.loads(codec.encode_payload(row)))
    assert again == row


def encoded() -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return codec.encode_record(RolloutSeal(rollout_id="r1", status="completed", sealed_at=1.0))


def test_decode_names_bad_field() -> None:
    key, value, headers = encoded()
    bad = orjson.dumps({**orjson.loads(value), "sealed_at": "yesterday"})
    with pytest.raises(DecodeError) as info:
        codec.decode(key, bad, headers)
    assert info.value.field == "sealed_at"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda k, v, h: (k, b"{not json", h), "value"),
        (lambda k, v, h: (k, b"[1]", h), "value"),
        (lambda k, v, h: (k, None, h), "value"),
        (lambda k, v, h: (k, v, [x for x in h if x[0] != codec.HEADER_TYPE]), "header tt-type"),
        (lambda k, v, h: (k, v, [(codec.HEADER_TYPE, b"nope"), *h[1:]]), "header tt-type"),
        (lambda k, v, h: (k, v, [(codec.HEADER_TYPE, EventType.ADMISSION.encode()), *h[1:]]), "call_id"),
        (lambda k, v, h: (k, v, [h[0], (codec.HEADER_SCHEMA, b"2"), h[2]]), "header tt-schema"),
        (lambda k, v, h: (k, v, [*h[:2], (codec.HEADER_EVENT_ID, b"seal/other")]), "header tt-event-id"),
        (lambda k, v, h: (b"r2", v, h), "key"),
        (lambda k, v, h: (None, v, h), "key"),
        (lambda k, v, h: (b"r1\xff", v, h), "key"),
        (lambda k, v, h: (k, v, [*h[:2], (codec.HEADER_EVENT_ID, b"\xfe")]), "header tt-event-id"),
        (lambda k, v, h: (k, b" " * (codec.MAX_EVENT_BYTES + 1), h), "value"),
        (lambda k, v, h: (k, v, [*h, ("x", b"h" * codec.MAX_EVENT_BYTES)]), "headers"),
        (lambda k, v, h: (k, orjson.dumps({**orjson.loads(v), "extra": 1}), h), "extra"),
        (lambda k, v, h: (k, orjson.dumps({**orjson.loads(v), "schema_version": 9}), h), "schema_version"),
    ],
)
def test_decode_errors(mutate: Any, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode(*mutate(*encoded()))
    assert info.value.field == field


def test_a_rule_across_fields_names_its_field() -> None:
    admission = CaptureAdmission(
        rollout_id="r1",
        call_id="c2",
        parent_call_id="c1",
        prev_len=3,
        mode="token_in",
        staging_chain=["r1/c1"],
        parent_chain_hash="a" * 64,
        admitted_at=1.0,
    )
    key, value, headers = codec.encode_record(admission)
    foreign = orjson.dumps({**orjson.loads(value), "staging_chain": ["r9/c1"]})
    with pytest.raises(DecodeError) as info:
        codec.decode(key, foreign, headers)
    assert info.value.field == "staging_chain"
    assert info.value.reason == "key 'r9/c1' is not of rollout 'r1'"
    too_long = orjson.dumps(
        {**orjson.loads(value), "staging_chain": [f"r1/k{i}" for i in range(MAX_CHAIN_DEPTH)]}
    )
    with pytest.raises(DecodeError) as info:
        codec.decode(key, too_long, headers)
    assert info.value.field == "staging_chain"
    assert f"at most {MAX_CHAIN_DEPTH - 1} items" in info.value.reason


def test_an_event_over_the_limit_is_refused_naming_it() -> None:
    failed = FailedCall(
        rollout_id="r1", call_id="c1", reason="never_staged", detail="x" * codec.MAX_EVENT_BYTES
    )
    with pytest.raises(codec.EventTooLarge, match=r"event com/r1/c1 \(call_failed\) is \d+ bytes"):
        codec.encode_record(failed)


def letter(value: bytes, **fields: Any) -> DeadLetter:
    return DeadLetter(
        source_topic="tt.admission",
        source_partition=1,
        source_offset=7,
        value_b64=base64.b64encode(value).decode(),
        stage="ledger",
        **{"reason": "bad", "key": "r1", "headers": {"tt-type": "admission"}, **fields},
    )


def test_a_dead_letter_that_fits_is_kept_whole() -> None:
    small = letter(b"\x00" * 1000)
    assert codec.fit_dead_letter(small) is small
    assert codec.decode(*codec.encode_record(small)).payload == small


def test_an_oversized_dead_letter_keeps_a_prefix_and_the_full_size() -> None:
    raw = bytes(range(256)) * (codec.MAX_EVENT_BYTES // 256 + 100)
    headers = {f"h{i}": "v" * 5000 for i in range(200)}
    fitted = codec.fit_dead_letter(letter(raw, headers=headers).model_copy(update={"reason": "r" * 10**6}))
    key, value, headers_out = codec.encode_record(fitted)  # writable: no EventTooLarge
    assert codec.record_size(key, value, headers_out) <= codec.MAX_EVENT_BYTES
    kept = base64.b64decode(fitted.value_b64)
    assert fitted.value_truncated_from == len(raw) and raw.startswith(kept)
    assert len(kept) > codec.MAX_EVENT_BYTES // 2
    assert len(fitted.headers) == codec.DEAD_LETTER_HEADERS + 1 and fitted.reason.endswith("[1000000 chars]")
    assert (fitted.source_topic, fitted.source_offset, fitted.key) == ("tt.admission", 7, "r1")


def test_topic_names() -> None:
    names = TopicNames(prefix="tt", partitions=2)
    assert names.all() == ("tt.admission", "tt.staged", "tt.committed", "tt.finalized", "tt.deadletter")
    assert topic_for(names, "seal") == "tt.admission"
    with pytest.raises(ValueError, match="partitions"):
        TopicNames(partitions=0)
    with pytest.raises(ValueError, match="prefix"):
        TopicNames(prefix="a b")
