"""The TransferQueue data plane, against a real in-process controller and storage unit.

One embedded data plane serves the whole module; other processes attach to it through
its published address file with the ordinary TransferQueue client.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import layout1_rows
import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from pipeline.dataplane import columns, packed
from pipeline.dataplane import encoding as codec
from pipeline.dataplane.addresses import DataPlaneAddresses
from pipeline.dataplane.config import ADDRESSES_FILE_NAME, DataPlaneConfig
from pipeline.dataplane.embedded import (
    TESTED_TRANSFERQUEUE_VERSION,
    EmbeddedDataPlane,
    actor_class,
    held_slot_manager,
)
from pipeline.dataplane.reattach import ReattachingDataPlane
from pipeline.dataplane.runtime import open_data_plane
from pipeline.dataplane.transferqueue import CorruptRows, TransferQueueDataPlane
from stages.ports import DataPlaneError, DataPlaneTimeout, MissingRows
from topics import digest
from topics.records import CallSpan, StagedCall, TrainingSample
from topics.staging import StagedRow, staging_row

pytestmark = pytest.mark.dataplane

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_ENV = {**os.environ, "TQ_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}


# ------------------------------------------------------------------ builders


def build_rollout(
    rng: np.random.Generator, rollout_id: str, lengths: Sequence[int], *, extras: dict[str, Any] | None = None
) -> list[StagedCall]:
    """A chain of valid calls (each the child of the previous) with the given delta lengths."""
    calls: list[StagedCall] = []
    prefix = np.zeros(0, dtype=np.int64)
    parent: StagedCall | None = None
    for index, length in enumerate(lengths):
        generated = int(rng.integers(1, length + 1))
        prompt = np.concatenate((prefix, rng.integers(0, 150_000, length - generated)))
        new_ids = rng.integers(0, 150_000, generated)
        delta = digest.build_delta(prompt, new_ids, -rng.random(generated) * 8, len(prefix))
        call = staging_row(
            rollout_id=rollout_id,
            call_id=f"c{index}",
            parent_call_id=None if parent is None else parent.call_id,
            parent_chain_hash=None if parent is None else parent.chain_hash,
            prefix_ids=prefix,
            delta=delta,
            weight_version=int(rng.integers(0, 5)),
            extras=extras,
        )
        calls.append(call)
        prefix = np.concatenate((prompt, new_ids))
        parent = call
    return calls


def as_arrays(call: StagedCall) -> StagedRow:
    """The row as the capture path hands it to the data plane: its vectors as arrays."""
    fields = call.model_dump(exclude={"token_ids_delta", "token_mask_delta", "logprobs_delta"})
    return StagedRow(
        **fields,
        token_ids=np.asarray(call.token_ids_delta, dtype=np.int64),
        token_mask=np.asarray(call.token_mask_delta, dtype=np.float32),
        logprobs=np.asarray(call.logprobs_delta, dtype=np.float32),
    )


def build_sample(rollout_id: str, calls: Sequence[StagedCall], reward: float | None) -> TrainingSample:
    """Linearize a chain into its training sample."""
    spans = []
    ids: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for call in calls:
        gen = int(sum(call.token_mask_delta))
        spans.append(
            CallSpan(call_id=call.call_id, start=len(ids), carry_len=call.delta_len - gen, gen_len=gen)
        )
        ids += call.token_ids_delta
        mask += call.token_mask_delta
        logprobs += call.logprobs_delta
        versions += [call.weight_version] * call.delta_len
    return TrainingSample(
        rollout_id=rollout_id,
        group_id="g1",
        token_ids=ids,
        token_mask=mask,
        logprobs=logprobs,
        weight_versions=versions,
        spans=spans,
        reward=reward,
        cumulative_hash=digest.cumulative_hash(ids),
    )


def f32_bits(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def assert_same_call(got: StagedCall, want: StagedCall) -> None:
    """Bit-exact: ids and every scalar equal, masks and logprobs equal as float32 bits."""
    assert np.array_equal(np.asarray(got.token_ids_delta, dtype=np.int64), np.asarray(want.token_ids_delta))
    assert np.array_equal(f32_bits(got.token_mask_delta), f32_bits(want.token_mask_delta))
    assert np.array_equal(f32_bits(got.logprobs_delta), f32_bits(want.logprobs_delta))
    heavy = {"token_ids_delta", "token_mask_delta", "logprobs_delta"}
    assert got.model_dump(exclude=heavy) == want.model_dump(exclude=heavy)
    assert type(got.token_ids_delta[0]) is int and type(got.logprobs_delta[0]) is float


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedDataPlane]:
    with EmbeddedDataPlane.start() as embedded:
        embedded.publish(tmp_path_factory.mktemp("dataplane") / ADDRESSES_FILE_NAME)
        yield embedded


@pytest.fixture
async def plane(server: EmbeddedDataPlane) -> AsyncIterator[TransferQueueDataPlane]:
    async with await TransferQueueDataPlane.attach(server.addresses, timeout_s=20.0) as attached:
        yield attached


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20251130)


# ------------------------------------------------------------------ the embedded data plane itself


def test_embedded_plane_relies_on_pinned_transferqueue_internals(
    server: EmbeddedDataPlane, tmp_path: Path
) -> None:
    """Fails loudly when TransferQueue or Ray change what the in-process construction uses."""
    import transfer_queue
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    assert transfer_queue.__version__ == TESTED_TRANSFERQUEUE_VERSION, (
        "the embedded data plane builds TransferQueue's actor classes in-process; re-check "
        "pipeline/dataplane/embedded.py against this version before moving the pin"
    )
    assert actor_class(TransferQueueController).__name__ == "TransferQueueController"
    assert actor_class(SimpleStorageUnit).__name__ == "SimpleStorageUnit"
    # Rows move through the client's storage manager, past async_put's custom-metadata call.
    from transfer_queue.client import AsyncTransferQueueClient
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

    assert callable(AsyncSimpleStorageManager.put_data) and callable(AsyncSimpleStorageManager.get_data)
    assert "storage_manager.put_data" in inspect.getsource(AsyncTransferQueueClient.async_put)
    assert "storage_manager.get_data" in inspect.getsource(AsyncTransferQueueClient.async_get_data)
    addresses = server.addresses
    assert addresses.pid == os.getpid() and addresses.mode == "embedded"
    assert {addresses.controller.ip, *(u.ip for u in addresses.storage_units)} == {"127.0.0.1"}
    assert len(addresses.storage_units) == 1
    # Published atomically, and round-trips through JSON and the environment variable.
    assert DataPlaneAddresses.read(server.published[0]) == addresses
    assert DataPlaneAddresses.from_json(addresses.to_json()) == addresses
    assert DataPlaneAddresses.from_env({"TOKENTRAIL_DATAPLANE_ADDRESSES": addresses.to_json()}) == addresses


def test_a_second_embedded_plane_starts_fast_and_stops_cleanly(server: EmbeddedDataPlane) -> None:
    started = time.perf_counter()
    with EmbeddedDataPlane.start() as other:
        assert time.perf_counter() - started < 5.0  # no Ray runtime: about half a second
        port = other.addresses.controller.ports["request_handle_socket"]
        assert other.running and other.addresses.controller.id != server.addresses.controller.id
    assert not other.running
    other.stop()  # idempotent
    import socket

    with socket.socket() as probe:  # the owner released its ports
        probe.bind(("127.0.0.1", port))


# ------------------------------------------------------------------ round trips


@pytest.mark.anyio
async def test_thousand_calls_round_trip_bit_exact(
    plane: TransferQueueDataPlane, rng: np.random.Generator
) -> None:
    prefix = unique("rt")
    calls: list[StagedCall] = []
    for r in range(250):
        extras = {"policy_epochs": [[0, 1]], "note": "é", "ratio": 0.1} if r % 5 == 0 else None
        calls += build_rollout(rng, f"{prefix}.{r}", rng.integers(100, 8001, 4).tolist(), extras=extras)
    assert len(calls) == 1000
    by_key = {call.staging_key: call for call in calls}
    for start in range(0, len(calls), 32):  # every other batch as arrays, as capture writes them
        batch = calls[start : start + 32]
        await plane.put_calls([as_arrays(call) for call in batch] if start % 64 else batch)
    assert set(by_key) <= set(await plane.list_keys("staging"))

    order = list(by_key)
    rng.shuffle(order)
    seen: set[str] = set()
    position = 0
    while position < len(order):
        size = int(rng.integers(1, 65))
        batch = order[position : position + size]
        position += size
        got = await plane.get_calls(batch)
        assert list(got) == batch
        for key in batch:
            assert_same_call(got[key], by_key[key])
            seen.add(key)
    assert seen == set(by_key)
    # The digest of a decoded row is the digest it was written with.
    for key in order[:50]:
        row = (await plane.get_calls([key]))[key]
        assert digest.call_digest(row.model_dump(exclude={"digest"})) == row.digest

    await plane.delete_calls(order)
    assert not set(by_key) & set(await plane.list_keys("staging"))


@pytest.mark.anyio
async def test_logprobs_come_back_as_their_float32_values(plane: TransferQueueDataPlane) -> None:
    row = build_rollout(np.random.default_rng(1), unique("f32"), [40])[0]
    precise = [0.0 if m == 0.0 else -0.1 * (i + 1) / 3 for i, m in enumerate(row.token_mask_delta)]
    written = StagedCall.model_construct(**{**dict(row), "logprobs_delta": precise})
    await plane.put_calls([written])
    got = (await plane.get_calls([row.staging_key]))[row.staging_key]
    assert got.logprobs_delta == np.asarray(precise, dtype=np.float32).astype(np.float64).tolist()
    assert got.logprobs_delta != precise  # really rounded: the stored values are float32
    assert np.array_equal(f32_bits(got.logprobs_delta), f32_bits(precise))


@pytest.mark.anyio
async def test_training_sample_round_trip(plane: TransferQueueDataPlane, rng: np.random.Generator) -> None:
    samples = []
    for i, reward in enumerate((1.0, None, -0.25)):
        rollout = unique(f"s{i}")
        samples.append(build_sample(rollout, build_rollout(rng, rollout, [300, 120, 900]), reward))
    for sample in samples:
        await plane.put_samples([sample])
    keys = [s.rollout_id for s in reversed(samples)]
    got = await plane.get_samples(keys)
    assert list(got) == keys
    for sample in samples:
        back = got[sample.rollout_id]
        assert back == sample
        assert back.spans == sample.spans and type(back.spans[0]) is CallSpan
        assert np.array_equal(f32_bits(back.logprobs), f32_bits(sample.logprobs))
        assert TrainingSample.model_validate(back.model_dump()) == sample
    assert set(keys) <= set(await plane.list_keys("samples"))
    await plane.delete_samples(keys)
    await plane.delete_samples(keys)
    with pytest.raises(MissingRows) as info:
        await plane.get_samples(keys[:1])
    assert info.value.keys == (keys[0],)


# ------------------------------------------------------------------ silent failures, guarded


@pytest.mark.anyio
async def test_partly_missing_keys_name_exactly_the_missing(
    plane: TransferQueueDataPlane, rng: np.random.Generator
) -> None:
    calls = build_rollout(rng, unique("miss"), [150, 200, 250])
    await plane.put_calls(calls)
    present = [c.staging_key for c in calls]
    ghost_a, ghost_b = f"{calls[0].rollout_id}/ghost", f"{unique('other')}/c0"
    with pytest.raises(MissingRows) as info:
        await plane.get_calls([present[0], ghost_a, present[1], ghost_b, present[2]])
    assert info.value.keys == (ghost_a, ghost_b)
    assert info.value.partition == "staging"
    assert not isinstance(info.value, CorruptRows)

    # A put that crashed after registering its key: listed, but unreadable.
    crashed = f"{calls[0].rollout_id}/crashed"
    await plane.client.async_kv_retrieve_meta(keys=[crashed], partition_id="staging", create=True)
    assert crashed in await plane.list_keys("staging")
    with pytest.raises(MissingRows) as info:
        await plane.get_calls([*present, crashed, ghost_a])
    assert info.value.keys == (crashed, ghost_a)
    assert list(await plane.get_calls(present)) == present  # the good rows stay readable
    await plane.delete_calls([crashed, *present])
    assert crashed not in await plane.list_keys("staging")


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # TransferQueue's cast
async def test_rows_missing_a_field_or_with_a_wrong_dtype_are_named(
    server: EmbeddedDataPlane, rng: np.random.Generator
) -> None:
    partition = unique("corrupt")  # a foreign writer's rows must not disturb other tests
    async with await TransferQueueDataPlane.attach(
        server.addresses, timeout_s=20.0, staging_partition=partition
    ) as plane:
        calls = build_rollout(rng, unique("bad"), [120, 130, 140, 150, 160, 170, 180])
        good, foreign, wrong_dtype, bad_meta, old_no_logprobs = (
            calls[:3],
            calls[3],
            calls[4],
            calls[5],
            calls[6],
        )
        await plane.put_calls(good)

        async def raw_put(call: StagedCall, fields: dict[str, Any]) -> None:
            meta = await plane.client.async_kv_retrieve_meta(
                keys=[call.staging_key], partition_id=partition, create=True
            )
            await plane.client.async_put(TensorDict(fields, batch_size=[1]), meta)

        await raw_put(foreign, {"blob": torch.zeros(1, 8, dtype=torch.int64)})
        await raw_put(
            wrong_dtype,
            {
                codec.ROW_FIELD: torch.nested.as_nested_tensor(
                    [torch.ones(3, dtype=torch.float64)], layout=torch.jagged
                )
            },
        )
        packed = codec.encode_calls([bad_meta]).get(codec.ROW_FIELD).tolist()[0].numpy().tobytes()
        meta_at = packed.index(b'{"schema_version"')
        await raw_put(
            bad_meta,
            {
                codec.ROW_FIELD: NonTensorStack(
                    packed_row(packed[:meta_at] + b'{"rollout_id": 1}' + b" " * 50)
                )
            },
        )
        old = layout1_rows.encode_calls([old_no_logprobs])
        await raw_put(
            old_no_logprobs, {name: old.get(name) for name in columns.CALL_FIELDS if name != "logprobs"}
        )
        keys = [c.staging_key for c in calls]
        with pytest.raises(CorruptRows) as info:
            await plane.get_calls(keys)
        error = info.value
        assert isinstance(error, MissingRows)
        assert error.keys == tuple(c.staging_key for c in calls[3:])
        assert f"'{codec.ROW_FIELD}'" in error.problems[foreign.staging_key]
        assert f"'{codec.ROW_FIELD}'" in error.problems[wrong_dtype.staging_key]
        assert "float64" in error.problems[wrong_dtype.staging_key]
        assert "meta.schema_version" in error.problems[bad_meta.staging_key]
        assert "'logprobs'" in error.problems[old_no_logprobs.staging_key]  # named in its own layout
        assert old_no_logprobs.staging_key in str(error) and "logprobs" in str(error)
        assert list(await plane.get_calls([c.staging_key for c in good])) == [c.staging_key for c in good]
        await plane.delete_calls(keys)


def packed_row(blob: bytes) -> torch.Tensor:
    """A row's bytes whose header is made to describe them (a foreign writer's mistake
    inside a well-formed row), as TransferQueue stores it."""
    header = packed.CALL_SECTIONS.header
    magic, *counts = header.unpack_from(blob)
    counts[-1] = (
        len(blob)
        - header.size
        - sum(
            n * dtype.itemsize
            for n, (_, dtype) in zip(counts[:-1], packed.CALL_SECTIONS.dtypes, strict=False)
        )
    )
    return torch.frombuffer(bytearray(header.pack(magic, *counts) + blob[header.size :]), dtype=torch.uint8)


@pytest.mark.anyio
async def test_rows_of_the_previous_layout_are_read_alone_and_mixed_with_new_ones(
    plane: TransferQueueDataPlane, rng: np.random.Generator
) -> None:
    """A data plane that outlives an upgrade holds layout-1 rows: readers still read them,
    and a batch of both layouts comes back whole, in the order asked."""
    calls = build_rollout(rng, unique("old"), [90, 100, 110, 120, 130, 140])
    old, new = calls[::2], calls[1::2]
    old_meta = await plane.client.async_kv_retrieve_meta(
        keys=[c.staging_key for c in old], partition_id="staging", create=True
    )
    await plane.client.async_put(layout1_rows.encode_calls(old), old_meta)
    await plane.put_calls(new)
    keys = [c.staging_key for c in calls]
    assert list(await plane.get_calls(keys[::2])) == keys[::2]
    got = await plane.get_calls(keys)
    assert list(got) == keys
    for call in calls:
        assert_same_call(got[call.staging_key], call)

    samples = [build_sample(unique(f"olds{i}"), calls, float(i)) for i in range(4)]
    old_samples = samples[:2]
    sample_meta = await plane.client.async_kv_retrieve_meta(
        keys=[s.key for s in old_samples], partition_id="samples", create=True
    )
    await plane.client.async_put(layout1_rows.encode_samples(old_samples), sample_meta)
    await plane.put_samples(samples[2:])
    order = [samples[2].key, samples[0].key, samples[3].key, samples[1].key]
    back = await plane.get_samples(order)
    assert list(back) == order
    assert all(back[s.key] == s for s in samples)
    await plane.delete_calls(keys)
    await plane.delete_samples(order)


def test_codec_names_the_key_and_field_of_a_malformed_row(rng: np.random.Generator) -> None:
    # Both layouts hand a row's parts to the record builders in one order.
    assert [name for name, _ in packed.CALL_SECTIONS.dtypes] == list(columns.CALL_FIELDS)
    assert [name for name, _ in packed.SAMPLE_SECTIONS.dtypes] == list(columns.SAMPLE_FIELDS)
    call = build_rollout(rng, "codec", [50])[0]
    key = call.staging_key
    data = codec.encode_calls([call])
    assert [r.model_dump() for r in codec.decode_calls([key], data)] == [call.model_dump()]
    blob = data.get(codec.ROW_FIELD).tolist()[0].numpy().tobytes()
    header = packed.CALL_SECTIONS.header
    _, *counts = header.unpack_from(blob)

    def row(raw: bytes) -> TensorDict:
        return TensorDict(
            {codec.ROW_FIELD: NonTensorStack(torch.frombuffer(bytearray(raw), dtype=torch.uint8))},
            batch_size=[1],
        )

    three_counts = (
        header.pack(b"TTC2", 3, *counts[1:]) + blob[header.size : header.size + 24] + blob[header.size + 32 :]
    )
    cases = {
        "row": [
            row(blob[:10]),  # shorter than the header
            row(b"TTS2" + blob[4:]),  # a sample's magic
            row(blob + b"x"),  # longer than its header says
            TensorDict({"other": torch.zeros(1, 3)}, batch_size=[1]),  # no row field at all
            TensorDict({codec.ROW_FIELD: torch.zeros(1, 3, dtype=torch.int64)}, batch_size=[1]),
        ],
        "counts": [row(three_counts)],
        "meta": [row(blob[: -len(b"}")] + b"!")],
    }
    for field, bad_rows in cases.items():
        for bad in bad_rows:
            with pytest.raises(codec.RowFormatError) as info:
                codec.decode_calls([key], bad)
            assert info.value.field == field and info.value.key == key, str(info.value)

    old = layout1_rows.encode_calls([call])
    assert [r.model_dump() for r in columns.decode_calls([key], old)] == [call.model_dump()]

    def broken(**fields: Any) -> TensorDict:
        base = {name: old.get(name) for name in columns.CALL_FIELDS}
        base.update(fields)
        return TensorDict({k: v for k, v in base.items() if v is not None}, batch_size=[1])

    old_cases = {
        "token_mask": broken(token_mask=None),
        "logprobs": broken(
            logprobs=torch.nested.as_nested_tensor(
                [torch.zeros(50, dtype=torch.float64)], layout=torch.jagged
            )
        ),
        "counts": broken(counts=torch.zeros(1, 3, dtype=torch.int64)),
    }
    for field, bad in old_cases.items():
        with pytest.raises(codec.RowFormatError) as info:
            columns.decode_calls([key], bad)
        assert info.value.field == field and (info.value.key in (key, None)), str(info.value)

    with pytest.raises(codec.RowFormatError, match=r"logprobs.*finite"):
        codec.encode_calls([StagedCall.model_construct(**{**dict(call), "logprobs_delta": [-1e39] * 50})])
    with pytest.raises(codec.RowFormatError, match=r"logprobs.*finite"):
        codec.encode_calls([replace(as_arrays(call), logprobs=np.full(50, -np.inf, dtype=np.float32))])
    with pytest.raises(codec.RowFormatError, match=r"token_ids.*int64"):
        codec.encode_calls([replace(as_arrays(call), token_ids=np.zeros(50, dtype=np.uint64))])
    with pytest.raises(codec.RowFormatError, match=r"token_ids.*int64"):
        codec.encode_calls([StagedCall.model_construct(**{**dict(call), "token_ids_delta": [2**64] * 50})])


@pytest.mark.anyio
async def test_delete_is_idempotent(plane: TransferQueueDataPlane, rng: np.random.Generator) -> None:
    calls = build_rollout(rng, unique("del"), [100, 100])
    keys = [c.staging_key for c in calls]
    await plane.put_calls(calls)
    await plane.delete_calls(keys)
    await plane.delete_calls(keys)
    await plane.delete_calls([*keys, "never/written"])
    await plane.delete_calls([])
    await plane.delete_samples(["never-written"])
    assert not set(keys) & set(await plane.list_keys("staging"))
    await plane.put_calls(calls)  # a deleted key can be written again
    assert list(await plane.get_calls(keys)) == keys
    await plane.delete_calls(keys)


def test_a_freed_slot_goes_to_a_new_row_only_after_the_hold() -> None:
    now = [0.0]
    slots = held_slot_manager(10.0, clock=lambda: now[0])
    first = slots.allocate_indexes("staging", 3)
    slots.release_indexes("staging", first[:2])
    now[0] = 5.0
    slots.release_partition("staging")  # the third, freed later
    assert set(slots.allocate_indexes("samples", 3)).isdisjoint(first)
    now[0] = 10.0
    assert slots.allocate_indexes("samples", 3) == [*first[:2], max(first) + 4]  # the third still held
    now[0] = 15.0
    assert slots.allocate_indexes("staging", 1) == first[2:]


@pytest.mark.anyio
async def test_a_late_second_delete_of_a_row_leaves_the_rows_written_after_the_first(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several deleters remove one staged row (the finalizer, the worker once its rollout is
    finalized, the janitor), each in two steps: look the key up, then clear what it found.
    When one has looked up and the other deletes first, the rows written next must not take
    the freed slot: the late clear would delete them (a live rollout's row gone before the
    finalizer read it). A fresh plane, so no slot freed earlier stands in the way."""
    with EmbeddedDataPlane.start() as owner:
        async with (
            await TransferQueueDataPlane.attach(owner.addresses, timeout_s=20.0) as quick,
            await TransferQueueDataPlane.attach(owner.addresses, timeout_s=20.0) as late,
        ):
            done = build_rollout(rng, unique("done"), [60, 60])
            keys = [call.staging_key for call in done]
            await quick.put_calls(done)
            looked_up = anyio.Event()
            go_on = anyio.Event()
            clear = late.client.async_clear_samples

            async def clear_later(meta: Any) -> None:
                looked_up.set()
                await go_on.wait()
                await clear(meta)

            monkeypatch.setattr(late.client, "async_clear_samples", clear_later)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(late.delete_calls, keys)
                await looked_up.wait()
                await quick.delete_calls(keys)
                live = build_rollout(rng, unique("live"), [60, 60, 60, 60])
                await quick.put_calls(live)
                go_on.set()
            assert not set(keys) & set(await quick.list_keys("staging"))
            got = await quick.get_calls([call.staging_key for call in live])
            for call in live:
                assert_same_call(got[call.staging_key], call)


@pytest.mark.anyio
async def test_a_put_the_controller_never_registers_is_reported(
    plane: TransferQueueDataPlane, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = build_rollout(rng, unique("lost"), [80])[0]

    async def lost_notification(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(plane.client.storage_manager, "notify_data_update", lost_notification)
    with pytest.raises(DataPlaneError, match="not readable"):
        await plane.put_calls([call])
    monkeypatch.undo()
    await plane.put_calls([call])  # a retry overwrites the half-written row
    assert list(await plane.get_calls([call.staging_key])) == [call.staging_key]
    await plane.delete_calls([call.staging_key])


@pytest.mark.anyio
async def test_a_repeated_key_in_one_put_is_refused(
    plane: TransferQueueDataPlane, rng: np.random.Generator
) -> None:
    call = build_rollout(rng, unique("dup"), [60])[0]
    with pytest.raises(ValueError, match="repeats"):
        await plane.put_calls([call, call])


# ------------------------------------------------------------------ other processes

WRITER = r"""
import json, sys, time
import numpy as np
from transfer_queue import TransferQueueClient
from transfer_queue.utils.enum_utils import Role
from transfer_queue.utils.zmq_utils import ZMQServerInfo
from topics import digest
from topics.staging import staging_row
from pipeline.dataplane.encoding import encode_calls

path, rollout, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
doc = json.loads(open(path).read())
def info(role, e):
    return ZMQServerInfo(role=role, id=e["id"], ip=e["ip"], ports=e["ports"])
client = TransferQueueClient(f"writer-{rollout}", controller_info=info(Role.CONTROLLER, doc["controller"]))
units = {u["id"]: info(Role.STORAGE, u) for u in doc["storage_units"]}
client.initialize_storage_manager("SimpleStorage", {"zmq_info": units})

rng = np.random.default_rng(abs(hash(rollout)) % 2**32)
def call(call_id, n):
    delta = digest.build_delta([], rng.integers(0, 1000, n), -rng.random(n), 0)
    return staging_row(rollout_id=rollout, call_id=call_id, parent_call_id=None, parent_chain_hash=None,
                     prefix_ids=[], delta=delta, weight_version=1)
def put(rows):
    meta = client.kv_retrieve_meta(keys=[r.staging_key for r in rows], partition_id="staging", create=True)
    client.put(encode_calls(rows), meta)

rows = [call(f"c{i}", 64 + i) for i in range(count)]
put(rows)
for r in rows:
    print(r.model_dump_json(), flush=True)
print("READY", flush=True)
i = 0
while mode == "forever":
    put([call(f"loop{i}", 2000)])
    i += 1
client.close()
"""


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, *args],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def written_rows(process: subprocess.Popen[str]) -> list[StagedCall]:
    assert process.stdout is not None
    rows = []
    for line in process.stdout:
        if line.strip() == "READY":
            return rows
        rows.append(StagedCall.model_validate_json(line))
    raise AssertionError(
        f"writer exited early: {process.wait()} {process.stderr.read() if process.stderr else ''}"
    )


@pytest.mark.anyio
async def test_other_processes_write_rows_the_owner_reads_and_their_exit_is_harmless(
    server: EmbeddedDataPlane, plane: TransferQueueDataPlane, rng: np.random.Generator
) -> None:
    address_file = str(server.published[0])
    clean_id, killed_id = unique("clean"), unique("killed")
    clean = spawn(address_file, clean_id, "5", "once")
    killed = spawn(address_file, killed_id, "3", "forever")
    try:
        clean_rows = written_rows(clean)
        killed_rows = written_rows(killed)
        assert clean.wait(timeout=60) == 0
        await anyio.sleep(0.3)  # let the second writer get some puts in flight
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
    finally:
        for process in (clean, killed):
            if process.poll() is None:
                process.kill()
                process.wait()

    for rows in (clean_rows, killed_rows):
        got = await plane.get_calls([r.staging_key for r in rows])
        for row in rows:
            assert_same_call(got[row.staging_key], row)

    # The owner keeps serving: its own writes, and whatever the killed writer left.
    mine = build_rollout(rng, unique("after"), [500, 700])
    await plane.put_calls(mine)
    assert list(await plane.get_calls([c.staging_key for c in mine])) == [c.staging_key for c in mine]
    leftovers = [k for k in await plane.list_keys("staging") if k.startswith(f"{killed_id}/loop")]
    assert leftovers, "the killed writer should have written in its loop"
    try:
        await plane.get_calls(leftovers)
    except MissingRows as exc:  # at most a put cut short by the kill
        assert set(exc.keys) <= set(leftovers) and len(exc.keys) <= 1
    await plane.delete_calls([*leftovers, *(r.staging_key for r in clean_rows + killed_rows)])
    async with await TransferQueueDataPlane.attach(server.addresses, timeout_s=10.0) as fresh:
        assert list(await fresh.get_calls([c.staging_key for c in mine])) == [c.staging_key for c in mine]
    await plane.delete_calls([c.staging_key for c in mine])


# ------------------------------------------------------------------ a dead data plane


def start_cli(data_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "dataplane", "--data-dir", str(data_dir), "--json"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipeline.cli", *args]
    return subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=60)


def cli_addresses(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, (
        f"tokentrail dataplane exited: {process.wait()} {process.stderr.read() if process.stderr else ''}"
    )
    document: dict[str, Any] = json.loads(line)
    return document


async def assert_times_out(call: Any, timeout_s: float) -> DataPlaneTimeout:
    started = time.perf_counter()
    with pytest.raises(DataPlaneTimeout) as info:
        await call
    elapsed = time.perf_counter() - started
    assert elapsed < timeout_s + 1.5, f"took {elapsed:.2f}s with a {timeout_s}s timeout"
    return info.value


@pytest.mark.anyio
async def test_cli_data_plane_serves_stops_cleanly_and_a_dead_one_times_out(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    graceful_dir, killed_dir = tmp_path / "graceful", tmp_path / "killed"
    graceful, killed = start_cli(graceful_dir), start_cli(killed_dir)
    try:
        graceful_doc, killed_doc = cli_addresses(graceful), cli_addresses(killed)
        assert graceful_doc["addresses_file"] == str(graceful_dir / ADDRESSES_FILE_NAME)
        assert graceful_doc["controller"]["ip"] == "127.0.0.1" and graceful_doc["pid"] == graceful.pid
        assert killed_doc["pid"] == killed.pid

        # A second owner for the same directory is refused while the first lives.
        refused = await anyio.to_thread.run_sync(run_cli, "dataplane", "--data-dir", str(graceful_dir))
        assert refused.returncode == 1 and "running data plane" in refused.stderr

        calls = build_rollout(rng, unique("cli"), [300, 400])
        keys = [c.staging_key for c in calls]
        timeout_s = 1.0
        config = DataPlaneConfig(mode="attach", data_dir=killed_dir, timeout_s=timeout_s)
        async with open_data_plane(config) as remote:
            await remote.put_calls(calls)
            assert list(await remote.get_calls(keys)) == keys
            killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=30)
            error = await assert_times_out(remote.get_calls(keys), timeout_s)
            assert "did not finish within 1s" in str(error) and "staging" in str(error)
            assert f"pid {killed.pid}, is not running" in str(error)
            await assert_times_out(remote.put_calls(calls), timeout_s)
            await assert_times_out(remote.list_keys("staging"), timeout_s)
            await assert_times_out(remote.delete_calls(keys), timeout_s)
        # Attaching to a dead plane fails within the timeout too, never hangs.
        error = await assert_times_out(open_data_plane(config).__aenter__(), timeout_s)
        assert "not running" in str(error)

        graceful.send_signal(signal.SIGTERM)
        assert graceful.wait(timeout=30) == 0
        assert not (graceful_dir / ADDRESSES_FILE_NAME).exists()
        assert (killed_dir / ADDRESSES_FILE_NAME).exists()  # a killed owner leaves a stale file
    finally:
        for process in (graceful, killed):
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.anyio
async def test_open_data_plane_embedded_then_attach(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = build_rollout(rng, unique("open"), [100])
    key = calls[0].staging_key
    published = tmp_path / ADDRESSES_FILE_NAME
    with pytest.raises(DataPlaneError, match="no data-plane address file"):
        await open_data_plane(DataPlaneConfig(mode="attach", data_dir=tmp_path)).__aenter__()
    async with open_data_plane(DataPlaneConfig(data_dir=tmp_path, timeout_s=10.0)) as owner:
        assert published.exists()
        await owner.put_calls(calls)
        async with open_data_plane(DataPlaneConfig(mode="attach", data_dir=tmp_path)) as guest:
            assert_same_call((await guest.get_calls([key]))[key], calls[0])
        # The environment variable stands in for the file; an explicitly named file wins over it.
        monkeypatch.setenv("TOKENTRAIL_DATAPLANE_ADDRESSES", published.read_text())
        async with open_data_plane(DataPlaneConfig(mode="attach", data_dir=tmp_path / "elsewhere")) as guest:
            assert list(await guest.get_calls([key])) == [key]
        stale = DataPlaneAddresses.read(published).to_dict()
        stale["controller"]["ports"] = {"handshake_socket": 9, "request_handle_socket": 9}
        monkeypatch.setenv("TOKENTRAIL_DATAPLANE_ADDRESSES", json.dumps(stale))
        async with open_data_plane(DataPlaneConfig(mode="attach", addresses_file=published)) as guest:
            assert list(await guest.get_calls([key])) == [key]
        assert list(await owner.get_calls([key])) == [key]  # guests leaving changed nothing
        stopped_owner = owner
    assert not published.exists()
    with pytest.raises(DataPlaneError, match="closed"):
        await stopped_owner.get_calls([key])


# ------------------------------------------------------------------ TransferQueue on Ray

RAY_OWNER = r"""
import sys
import ray
import transfer_queue as tq
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
print("READY", flush=True)
sys.stdin.readline()
tq.close()
ray.shutdown()
"""


@pytest.mark.slow  # starting Ray takes 20-30 s on 2 cores
@pytest.mark.anyio
async def test_ray_mode_attaches_to_transferqueue_on_a_ray_cluster(rng: np.random.Generator) -> None:
    owner = await anyio.to_thread.run_sync(spawn_ray_owner)
    try:
        assert owner.stdout is not None
        assert (await anyio.to_thread.run_sync(owner.stdout.readline)).strip() == "READY"
        config = DataPlaneConfig(
            mode="ray", ray_address="auto", timeout_s=180.0
        )  # Ray is slow on 2 busy cores
        calls = build_rollout(rng, unique("ray"), [300, 500])
        async with open_data_plane(config) as plane:
            assert plane.addresses is not None and plane.addresses.mode == "ray"
            await plane.put_calls(calls)
            got = await plane.get_calls([c.staging_key for c in calls])
            for call in calls:
                assert_same_call(got[call.staging_key], call)
            await plane.delete_calls([c.staging_key for c in calls])
        import ray

        assert not ray.is_initialized()  # we left the cluster; TransferQueue stays up for its owner
    finally:
        if owner.stdin is not None:
            owner.stdin.write("\n")
            owner.stdin.flush()
        await anyio.to_thread.run_sync(lambda: owner.wait(timeout=60))


def spawn_ray_owner() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RAY_OWNER],
        cwd=REPO,
        env={**SUBPROCESS_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


@pytest.mark.anyio
async def test_an_attached_client_follows_a_restarted_owner_and_rows_held_come_back(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """Kill the owner, start a new one on the same data dir: the attached client re-attaches
    by itself, its listener stages held rows again, and a reader attaching to the young
    owner waits for them instead of reporting them missing."""
    calls = build_rollout(rng, unique("follow"), [300, 400])
    keys = [c.staging_key for c in calls]
    first = start_cli(tmp_path)
    second: subprocess.Popen[str] | None = None
    try:
        cli_addresses(first)
        config = DataPlaneConfig(mode="attach", data_dir=tmp_path, timeout_s=2.0)
        async with open_data_plane(config) as attached:
            assert isinstance(attached, ReattachingDataPlane)
            restaged: list[int] = []

            async def stage_again(plane: Any) -> None:
                await plane.put_calls(calls)
                restaged.append(len(calls))

            attached.on_reattach(stage_again)
            await attached.put_calls(calls)
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
            second = start_cli(tmp_path)
            cli_addresses(second)
            finalizing = DataPlaneConfig(
                mode="attach", data_dir=tmp_path, timeout_s=2.0, restage_grace_s=10.0
            )
            async with open_data_plane(finalizing) as reader:  # attaches to the new, still empty owner
                got = await reader.get_calls(keys)  # waits while the owner is young
            assert list(got) == keys and restaged == [len(calls)] and attached.reattaches == 1
            assert_same_call(got[keys[0]], calls[0])
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.anyio
async def test_a_call_made_while_the_owner_is_dead_waits_for_its_successor_only_when_asked(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """The finalizer's client (``owner_wait_s``) outlives a dead owner: its call waits for
    the successor and goes through there; a worker's client (no wait) fails at once."""
    calls = build_rollout(rng, unique("successor"), [200])
    first = start_cli(tmp_path)
    second: subprocess.Popen[str] | None = None
    try:
        cli_addresses(first)
        impatient = DataPlaneConfig(mode="attach", data_dir=tmp_path, timeout_s=2.0)
        patient = replace(impatient, owner_wait_s=60.0)
        async with open_data_plane(impatient) as worker, open_data_plane(patient) as finalizer:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
            with pytest.raises(DataPlaneError):
                await worker.put_calls(calls)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(finalizer.put_calls, calls)
                second = start_cli(tmp_path)
                await anyio.to_thread.run_sync(cli_addresses, second)
            got = await finalizer.get_calls([c.staging_key for c in calls])
            assert isinstance(finalizer, ReattachingDataPlane) and finalizer.reattaches == 1
            assert_same_call(got[calls[0].staging_key], calls[0])
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
