"""The bad-input cases sent to the broker: every kind of corruption, one case each.

Each case publishes its input under its own rollout id, built from real captures
(``badinput.Kit``); ``CASES`` is the table ``test_bad_events`` runs, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from badinput import (
    Build,
    Case,
    Chain,
    Failed,
    Kit,
    Letter,
    Raw,
    Send,
    believed,
    completed,
    headers_for,
    raw,
    recoord,
    with_fields,
)

from topics import codec
from topics.codec import HEADER_EVENT_ID, HEADER_SCHEMA, HEADER_TYPE, MAX_EVENT_BYTES
from topics.records import MAX_CHAIN_DEPTH, FinalizedEvent

# ============================================================================ the cases


def slipped_in(make: Callable[[Chain], Raw], at: int = 1) -> Build:
    """A good two-call rollout with one bad record slipped in after its ``at``-th event."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid)
        events = chain.events()
        return [*events[:at], make(chain), *events[at:]]

    return build


def _field_lie(call: int, expect: Letter, **fields: Any) -> Callable[[Chain], Raw]:
    """A copy of call ``call``'s admission with fields the model refuses."""

    def make(chain: Chain) -> Raw:
        admission = chain.admissions[call]
        return raw(admission, expect, value=with_fields(admission, **fields))

    return make


def _huge_header(chain: Chain) -> Raw:
    first = chain.admissions[0]
    blob = ("x-blob", b"h" * (MAX_EVENT_BYTES + 8))
    return raw(first, Letter("ledger", "headers", OVER), headers=(*headers_for(first), blob))


def first_admission(expect: Letter, **changes: Any) -> Build:
    """A copy of the rollout's first admission, changed, slipped in after the original."""
    return slipped_in(lambda chain: raw(chain.admissions[0], expect, **changes))


async def _replaced_admission(kit: Kit, rid: str) -> list[Send]:
    """Call 2's admission arrives corrupted: dead-lettered, and its staged event then has
    no admission, which rejects the rollout (call 2 is its end)."""
    chain = await kit.chain(rid)
    events = chain.events()
    cut = codec.encode_payload(chain.admissions[1])[:-9]
    events[2] = raw(chain.admissions[1], Letter("ledger", "value", "not JSON"), value=cut)
    return events


async def _unknown_header(kit: Kit, rid: str) -> list[Send]:
    """The rollout's only copy of its first admission carries a header nobody knows."""
    chain = await kit.chain(rid)
    events = chain.events()
    first = chain.admissions[0]
    events[0] = raw(first, None, headers=(*headers_for(first), ("x-trace", b"\xff\x00 not utf-8")))
    return events


def _finalized_on_admission_topic(chain: Chain) -> Raw:
    final = FinalizedEvent(
        rollout_id=chain.rollout_id,
        status="rejected",
        rejection_reason="no_calls",
        prompt_len=0,
        total_len=0,
        generated_tokens=0,
        call_count=0,
        finalized_at=1.0,
    )
    return raw(final, Letter("ledger", TYPE, "does not belong on this topic"))


def _malformed_receipt(chain: Chain) -> Raw:
    letter = Letter("finalizer", "value", "not JSON")
    seal = completed(chain.rollout_id)  # its key and id headers, typed as a receipt
    return raw(seal, letter, role="committed", type=b"receipt", value=b'{"rollout_id": ')


def _huge_chain(chain: Chain) -> Raw:
    """An admission of 3.3 MB: a chain of 150,000 keys (its dead letter must be trimmed)."""
    admission = chain.admissions[1]
    keys = [f"{chain.rollout_id}/k{i}" for i in range(150_000)]
    value = with_fields(admission, staging_chain=[*keys, *(admission.staging_chain or [])])
    letter = Letter("ledger", "staging_chain", f"at most {MAX_CHAIN_DEPTH - 1} items")
    return raw(admission, letter, value=value)


def _lie(real_worker: bool, lie: Callable[[Chain], dict[str, Any]]) -> Build:
    """Call 2's admission lies. With ``real_worker`` the capture core serves the same
    admission (and catches the lie); otherwise a worker believed it and its coords
    agree with the lie, so only the ledger's lineage check is left to catch it."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid, turns=1)
        truth, lying = kit.child(chain, **lie(chain))
        staged = await kit.call(lying, 1) if real_worker else believed(lying, await kit.call(truth, 1))
        return [*chain.events()[:-1], lying, staged, completed(rid)]

    return build


async def _forged_chain_hash(kit: Kit, rid: str) -> list[Send]:
    """The worker was sent the truth; the admission on the log names another parent hash."""
    chain = await kit.chain(rid, turns=1)
    truth, lying = kit.child(chain, parent_chain_hash="0" * 64)
    return [*chain.events()[:-1], lying, await kit.call(truth, 1), completed(rid)]


def _foreign_parent(real_worker: bool) -> Build:
    """Call 2 names a call of another rollout as its parent: that call's id, chain hash
    and length (the chain key rewritten to this rollout, so the record is valid)."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        theirs = (await kit.chain(f"{rid}-other", turns=1)).coords[0]
        chain = await kit.chain(rid, turns=1)
        truth, lying = kit.child(
            chain,
            parent_call_id=theirs.call_id,
            staging_chain=[f"{rid}/{theirs.call_id}"],
            parent_chain_hash=theirs.chain_hash,
            prev_len=theirs.cum_len,
        )
        staged = await kit.call(lying, 1) if real_worker else believed(lying, await kit.call(truth, 1))
        return [*chain.events()[:-1], lying, staged, completed(rid)]

    return build


async def _foreign_chain_key(kit: Kit, rid: str) -> list[Send]:
    """Call 2's chain holds another rollout's key: not even a valid record. The worker
    refuses such a request (HTTP 400, in test_bad_http), so no staged event follows it,
    and the rollout ends on its first call."""
    theirs = (await kit.chain(f"{rid}-other", turns=1)).coords[0]
    chain = await kit.chain(rid, turns=1)
    truth, _ = kit.child(chain)
    value = with_fields(truth, staging_chain=[theirs.staging_key])
    letter = Letter("ledger", "staging_chain", "is not of rollout")
    return [*chain.events()[:-1], raw(truth, letter, value=value), completed(rid)]


def _coords_disagree(change: Callable[[Chain], dict[str, Any]]) -> Build:
    """Call 2's staged coords disagree with its admission."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid)
        events = chain.events()
        events[3] = recoord(chain.staged[1], **change(chain))
        return events

    return build


def _short_prefix(chain: Chain) -> dict[str, Any]:
    return {"prev_len": chain.coords[-1].cum_len - 1}


def _forged_ancestors(chain: Chain) -> dict[str, Any]:
    return {"staging_chain": [f"{chain.rollout_id}/x", *chain.coords[-1].staging_chain]}


def _zero_hash(chain: Chain) -> dict[str, Any]:
    return {"parent_call_id": chain.coords[-1].call_id, "parent_chain_hash": "0" * 64}


def _ghost_parent(chain: Chain) -> dict[str, Any]:
    return {"parent_call_id": "ghost", "staging_chain": [f"{chain.rollout_id}/ghost"]}


def _shifted(chain: Chain) -> dict[str, Any]:
    coords = chain.coords[1]
    return {"prev_len": coords.prev_len + 1, "cum_len": coords.cum_len + 1}


def _other_parent(chain: Chain) -> dict[str, Any]:
    return {"parent_call_id": "ghost"}


async def _seal_only(kit: Kit, rid: str) -> list[Send]:
    return [completed(rid)]


def _two_seals(second_reward: float, letter: Letter | None) -> Build:
    """Two seals while call 2 is still in flight, so both meet the open rollout."""

    async def build(kit: Kit, rid: str) -> list[Send]:
        chain = await kit.chain(rid)
        first = completed(rid, reward=1.0)
        second = first.model_copy(update={"reward": second_reward})
        events = chain.events(first)
        return [*events[:3], first, raw(second, letter), events[3]]

    return build


async def _conflicting_admission(kit: Kit, rid: str) -> list[Send]:
    chain = await kit.chain(rid)
    events = chain.events()
    other = chain.admissions[1].model_copy(update={"group_id": "not-the-same"})
    events.insert(3, raw(other, Letter("ledger", "group_id", "conflicting admission")))
    return events


async def _orphan_staged(kit: Kit, rid: str) -> list[Send]:
    """A staged event of a call nobody admitted (a root beside the real chain)."""
    chain = await kit.chain(rid)
    orphan = await kit.call(kit.client.admit(rid), 9)
    return [*chain.events()[:-1], orphan, completed(rid)]


NOT_JSON = Letter("ledger", "value", "not JSON")
TYPE = f"header {HEADER_TYPE}"
SCHEMA = f"header {HEADER_SCHEMA}"
EVENT_ID = f"header {HEADER_EVENT_ID}"
OVER = f"over the {MAX_EVENT_BYTES}-byte event limit"
HUGE = b'{"padding": "' + b"a" * (MAX_EVENT_BYTES + 1024) + b'"}'

CASES: list[Case] = [
    # malformed JSON ------------------------------------------------------------------
    Case(
        "truncated-json",
        "malformed JSON event",
        first_admission(NOT_JSON, value=b'{"call_id": "c'),
        "accepted",
    ),
    Case(
        "binary-garbage",
        "malformed JSON event",
        first_admission(NOT_JSON, value=b"\x00\xff\xfe\x80"),
        "accepted",
    ),
    Case(
        "json-array",
        "malformed JSON event",
        first_admission(Letter("ledger", "value", "expected a JSON object"), value=b"[1, 2]"),
        "accepted",
    ),
    Case(
        "malformed-needed-admission",
        "malformed JSON event",
        _replaced_admission,
        "unknown_admission",
        failed=(Failed("unknown_admission", "without an admission"),),
    ),
    Case("malformed-receipt", "malformed JSON event", slipped_in(_malformed_receipt), "accepted"),
    Case(
        "tombstone",
        "tombstone (null value)",
        first_admission(Letter("ledger", "value", "tombstone"), value=None),
        "accepted",
    ),
    # invalid fields ------------------------------------------------------------------
    Case(
        "string-prev-len",
        "invalid field",
        slipped_in(_field_lie(0, Letter("ledger", "prev_len", "valid integer"), prev_len="0")),
        "accepted",
    ),
    Case(
        "extra-field",
        "invalid field",
        slipped_in(_field_lie(0, Letter("ledger", "surprise", "Extra inputs"), surprise=1)),
        "accepted",
    ),
    Case(
        "text-mode-with-parent",
        "invalid field",
        slipped_in(
            _field_lie(1, Letter("ledger", "parent_call_id", "text-mode call has no parent"), mode="text"),
            at=3,
        ),
        "accepted",
    ),
    # unknown event types, envelopes that disagree with their payload -----------------
    Case(
        "bogus-type",
        "unknown event type",
        first_admission(Letter("ledger", TYPE, "unknown event type 'bogus'"), type=b"bogus"),
        "accepted",
    ),
    Case(
        "missing-type",
        "unknown event type",
        first_admission(Letter("ledger", TYPE, "missing"), type=None),
        "accepted",
    ),
    Case(
        "type-says-seal",
        "unknown event type",
        first_admission(Letter("ledger", "status", "Field required"), type=b"seal"),
        "accepted",
    ),
    Case("wrong-topic", "unknown event type", slipped_in(_finalized_on_admission_topic), "accepted"),
    Case(
        "event-id-lie",
        "envelope disagrees with payload",
        first_admission(Letter("ledger", EVENT_ID, "!= expected"), event_id=b"adm/x/y"),
        "accepted",
    ),
    Case(
        "other-key",
        "envelope disagrees with payload",
        first_admission(Letter("ledger", "key", "does not match rollout"), key=b"someone-else"),
        "accepted",
    ),
    Case("unknown-header", "unknown header", _unknown_header, "accepted"),
    # schema versions -----------------------------------------------------------------
    Case(
        "schema-header-5",
        "unknown schema version",
        first_admission(Letter("ledger", SCHEMA, "unsupported schema version '5'"), schema=b"5"),
        "accepted",
    ),
    Case(
        "schema-header-2",
        "unknown schema version",
        first_admission(Letter("ledger", SCHEMA, "unsupported schema version '2'"), schema=b"2"),
        "accepted",
    ),
    Case(
        "schema-payload-9",
        "unknown schema version",
        slipped_in(
            _field_lie(
                0, Letter("ledger", "schema_version", "unsupported schema_version 9"), schema_version=9
            )
        ),
        "accepted",
    ),
    # keys ----------------------------------------------------------------------------
    Case(
        "nonutf8-key",
        "non-UTF-8 key",
        first_admission(Letter("ledger", "key", "not UTF-8"), key=b"\xff\xfebad"),
        "accepted",
    ),
    Case(
        "nonutf8-header",
        "non-UTF-8 key",
        first_admission(Letter("ledger", EVENT_ID, "not UTF-8"), event_id=b"adm/\xff\xfe"),
        "accepted",
    ),
    Case(
        "missing-key",
        "missing key",
        first_admission(Letter("ledger", "key", "missing"), key=None),
        "accepted",
    ),
    # huge payloads -------------------------------------------------------------------
    Case(
        "huge-value", "huge payload", first_admission(Letter("ledger", "value", OVER), value=HUGE), "accepted"
    ),
    Case("huge-header", "huge payload", slipped_in(_huge_header), "accepted"),
    Case("huge-chain", "huge payload", slipped_in(_huge_chain, at=3), "accepted"),
    # admissions that lie -------------------------------------------------------------
    Case(
        "prev-len-lie-served",
        "admission lies: wrong prev_len",
        _lie(True, _short_prefix),
        "prefix_hash_mismatch",
        failed=(Failed("prefix_hash_mismatch", "capture failed"),),
    ),
    Case(
        "prev-len-lie-believed",
        "admission lies: wrong prev_len",
        _lie(False, _short_prefix),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "does not continue parent"),),
    ),
    Case(
        "forged-chain-believed",
        "admission lies: forged chain",
        _lie(False, _forged_ancestors),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "does not continue parent"),),
    ),
    Case(
        "forged-chain-served",
        "admission lies: forged chain",
        _lie(True, _forged_ancestors),
        "prefix_unavailable",
        failed=(Failed("prefix_unavailable", "capture failed"),),
    ),
    Case(
        "forged-chain-hash-served",
        "admission lies: forged chain",
        _lie(True, _zero_hash),
        "prefix_hash_mismatch",
        failed=(Failed("prefix_hash_mismatch", "capture failed"),),
    ),
    Case(
        "forged-chain-hash-logged",
        "admission lies: forged chain",
        _forged_chain_hash,
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "does not continue parent"),),
    ),
    Case(
        "unknown-parent-served",
        "admission lies: unknown parent",
        _lie(True, _ghost_parent),
        "prefix_unavailable",
        failed=(Failed("prefix_unavailable", "capture failed"),),
    ),
    Case(
        "unknown-parent-believed",
        "admission lies: unknown parent",
        _lie(False, _ghost_parent),
        "unknown_admission",
    ),
    Case(
        "foreign-parent-served",
        "admission lies: parent from another rollout",
        _foreign_parent(True),
        "prefix_unavailable",
        failed=(Failed("prefix_unavailable", "capture failed"),),
    ),
    Case(
        "foreign-parent-believed",
        "admission lies: parent from another rollout",
        _foreign_parent(False),
        "unknown_admission",
    ),
    Case(
        "foreign-chain-key",
        "admission lies: parent from another rollout",
        _foreign_chain_key,
        "accepted",
    ),
    # coords that disagree with the admission -----------------------------------------
    Case(
        "coords-prev-len",
        "coords disagree with admission",
        _coords_disagree(_shifted),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "prev_len: staged"),),
    ),
    Case(
        "coords-parent",
        "coords disagree with admission",
        _coords_disagree(_other_parent),
        "coords_mismatch",
        failed=(Failed("coords_mismatch", "parent_call_id: staged 'ghost'"),),
    ),
    # seals and duplicates ------------------------------------------------------------
    Case("seal-unknown-rollout", "seal for unknown rollout", _seal_only, "no_calls"),
    Case("duplicate-seal", "duplicate seal", _two_seals(1.0, None), "accepted", reward=1.0),
    Case(
        "conflicting-seal",
        "duplicate seal",
        _two_seals(0.0, Letter("ledger", "reward", "conflicting seal")),
        "accepted",
        reward=1.0,
    ),
    Case(
        "conflicting-admission",
        "duplicate admission that differs",
        _conflicting_admission,
        "accepted",
    ),
    Case(
        "orphan-staged",
        "staged event without admission",
        _orphan_staged,
        "accepted",
        failed=(Failed("unknown_admission", "without an admission"),),
    ),
]
