"""``stages.ports.DataPlane`` on TransferQueue's async KV API, with its silent failures guarded.

TransferQueue 0.1.11 answers some mistakes with plausible data instead of an error
(DESIGN §3). Each is guarded here:

- a key list that is partly missing returns fewer rows: every read compares what came
  back with what was asked, and raises ``MissingRows`` naming exactly the keys without
  a readable row;
- a read without ``select_fields`` returns only the fields all rows share: every read
  names its fields, and a row lacking one is reported (``CorruptRows``) by key and field;
- mixed dtypes in one field are cast: the row codec checks the dtype of every row and
  treats TransferQueue's casting fallback as a bad row;
- a put that crashed half way leaves its keys listed but unreadable: such keys count as
  missing on read, and a put is checked readable before it returns;
- RPCs have no timeout: every call runs under ``timeout_s`` and raises
  ``DataPlaneTimeout`` with the operation, partition and endpoint in the message;
- ``transfer_queue.close()`` from a non-owner kills the controller: this class only ever
  closes its own client.

Rows move through the client's storage manager (``put_data`` / ``get_data``), not
``async_put`` / ``async_get_data``: those wrap the same calls, but ``async_put`` also sends
every row's custom metadata (empty here) to the controller, one more round trip per put,
and both count the machine's physical cores on every call (about 40 µs). Together that
was a third of a one-row put's CPU in the caller.

Rows are read in whichever layout they were written (``encoding.CALL_LAYOUTS``): a data
plane that outlives an upgrade holds rows of both, and a batch of both is read apart.

When a batch is bad, the culprits are found by bisection (O(bad · log n) extra calls),
so the common path costs one metadata call and one data call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import numpy as np
from tensordict import TensorDict

from pipeline.dataplane import encoding as codec
from pipeline.dataplane.addresses import DataPlaneAddresses
from pipeline.dataplane.client import close_client, connect, connect_ray
from pipeline.dataplane.config import DEFAULT_RAY_NAMESPACE, DEFAULT_TIMEOUT_S, SLOT_REUSE_AFTER_S
from stages.ports import (
    SAMPLES_PARTITION,
    STAGING_PARTITION,
    DataPlane,
    DataPlaneError,
    DataPlaneTimeout,
    MissingRows,
)
from topics.records import StagedCall, TrainingSample
from topics.staging import CallRow

T = TypeVar("T")


class CorruptRows(MissingRows):
    """Some rows exist but cannot be decoded (a field missing, a wrong dtype, bad metadata).

    A ``MissingRows``: ``keys`` names every key without a readable row, corrupt or absent;
    ``problems`` maps each corrupt key to what is wrong with it, field included.
    """

    def __init__(self, partition: str, keys: Sequence[str], problems: Mapping[str, str]) -> None:
        super().__init__(partition, keys)
        self.problems = dict(problems)
        details = "; ".join(problems.values())
        absent = [key for key in keys if key not in problems]
        tail = f"; no row at all for {len(absent)} key(s): {', '.join(absent[:10])}" if absent else ""
        self.args = (f"{partition}: {len(problems)} corrupt row(s): {details}{tail}",)


@dataclass(frozen=True, slots=True)
class _Problem:
    kind: Literal["absent", "unreadable", "corrupt"]
    detail: str


class _ReadFailure(Exception):
    """Internal: a read of a key subset failed in a way bisection can narrow down."""

    def __init__(self, problem: _Problem) -> None:
        super().__init__(problem.detail)
        self.problem = problem


class _RowsChanged(Exception):
    """Internal: a read failed, yet every row checks out on a second look: a write raced it."""


_REREAD_PAUSE_S = 0.02


def _unique(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        raise TypeError("keys: expected a sequence of keys, got a single str")
    return list(dict.fromkeys(keys))


def _halves(keys: list[str]) -> tuple[list[str], list[str]]:
    mid = len(keys) // 2
    return keys[:mid], keys[mid:]


def _layout(present: Sequence[str], layouts: Sequence[codec.RowLayout]) -> codec.RowLayout:
    """The layout rows with fields ``present`` were written in: the first whose fields are
    all there, else the one most of whose fields are (to name what is missing)."""
    names = set(present)
    for layout in layouts:
        if names.issuperset(layout.fields):
            return layout
    return max(layouts, key=lambda layout: len(names.intersection(layout.fields)))


def _readable(meta: Any, count: int, fields: Sequence[str]) -> bool:
    """All ``count`` keys known, every field present in all of them, and produced."""
    return (
        meta.size == count
        and set(fields).issubset(meta.field_names)
        and bool(np.all(np.asarray(meta.production_status) == 1))
    )


class TransferQueueDataPlane:
    """Heavy rows and samples in TransferQueue, addressed by key (``stages.ports.DataPlane``).

    Use one instance from one event loop. ``close()`` closes this client only; the data
    plane itself belongs to whoever started it.
    """

    def __init__(
        self,
        client: Any,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        addresses: DataPlaneAddresses | None = None,
        staging_partition: str = STAGING_PARTITION,
        samples_partition: str = SAMPLES_PARTITION,
        verify_puts: bool = True,
        closer: Callable[[], None] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if addresses is not None and addresses.mode == "embedded" and timeout_s >= SLOT_REUSE_AFTER_S:
            raise ValueError(
                f"timeout_s: must be below {SLOT_REUSE_AFTER_S:g}s on an embedded data plane (a deleted "
                f"row's slot is held that long, so a delete that looked up before it cannot clear a new "
                f"row), got {timeout_s}"
            )
        self._client = client
        self.timeout_s = timeout_s
        self.addresses = addresses
        self.staging_partition = staging_partition
        self.samples_partition = samples_partition
        self.verify_puts = verify_puts
        self._closer = closer
        self._closed = False

    # ------------------------------------------------------------ construction

    @classmethod
    async def attach(
        cls, addresses: DataPlaneAddresses, *, timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any
    ) -> TransferQueueDataPlane:
        """Attach to a data plane by its published addresses (embedded or Ray)."""
        client = await connect(addresses, timeout_s=timeout_s)
        return cls(client, timeout_s=timeout_s, addresses=addresses, **options)

    @classmethod
    async def attach_ray(
        cls,
        ray_address: str | None = None,
        *,
        namespace: str = DEFAULT_RAY_NAMESPACE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **options: Any,
    ) -> TransferQueueDataPlane:
        """Attach to TransferQueue already running on a Ray cluster (``ray.init(address=...)``)."""
        made = await connect_ray(ray_address, namespace=namespace, timeout_s=timeout_s)
        return cls(made.client, timeout_s=timeout_s, addresses=made.addresses, closer=made.close, **options)

    @property
    def client(self) -> Any:
        """The underlying ``AsyncTransferQueueClient`` (diagnostics, benchmarks, other partitions)."""
        return self._client

    @property
    def endpoint(self) -> str:
        return self.addresses.controller_address if self.addresses is not None else "unknown endpoint"

    async def close(self) -> None:
        """Close this client (idempotent). Never stops the data plane itself."""
        if self._closed:
            return
        self._closed = True
        if self._closer is not None:
            self._closer()
        else:
            close_client(self._client)

    async def __aenter__(self) -> TransferQueueDataPlane:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ the DataPlane port

    async def put_calls(self, rows: Sequence[CallRow]) -> None:
        if not rows:
            return
        data = codec.encode_calls(rows)
        await self.put_rows(
            self.staging_partition, [row.staging_key for row in rows], data, codec.CALL_LAYOUTS[0]
        )

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]:
        return await self.get_rows(self.staging_partition, keys, codec.CALL_LAYOUTS)

    async def delete_calls(self, keys: Sequence[str]) -> None:
        await self.delete_rows(self.staging_partition, keys)

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None:
        if not samples:
            return
        data = codec.encode_samples(samples)
        await self.put_rows(
            self.samples_partition, [sample.key for sample in samples], data, codec.SAMPLE_LAYOUTS[0]
        )

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]:
        return await self.get_rows(self.samples_partition, keys, codec.SAMPLE_LAYOUTS)

    async def delete_samples(self, keys: Sequence[str]) -> None:
        await self.delete_rows(self.samples_partition, keys)

    async def list_keys(self, partition: str) -> list[str]:
        """Every key the controller lists, sorted; includes keys whose put never completed."""

        async def run() -> list[str]:
            info = await self._client.async_kv_list(partition)
            return sorted((info or {}).get(partition, {}))

        return await self._bounded("list", partition, 0, run)

    # ------------------------------------------------------------ generic rows

    async def put_rows(
        self, partition: str, keys: Sequence[str], data: TensorDict, layout: codec.RowLayout
    ) -> None:
        """Write one row per key in ``layout`` (overwriting a key that exists); returns once
        all are readable."""
        key_list = list(keys)
        if len(set(key_list)) != len(key_list):
            raise ValueError(f"{partition}: a key repeats within one put")
        if data.batch_size[0] != len(key_list):
            raise ValueError(f"{partition}: {data.batch_size[0]} rows for {len(key_list)} keys")
        await self._bounded(
            "put", partition, len(key_list), lambda: self._put(partition, key_list, data, layout)
        )

    async def get_rows(
        self, partition: str, keys: Sequence[str], layouts: Sequence[codec.RowLayout]
    ) -> dict[str, Any]:
        """Decoded rows by key, in the order asked, each read in the layout it was written
        in (one of ``layouts``); ``MissingRows`` unless every key has one."""
        key_list = _unique(keys)
        if not key_list:
            return {}
        return await self._bounded(
            "get", partition, len(key_list), lambda: self._get_settled(partition, key_list, layouts)
        )

    async def delete_rows(self, partition: str, keys: Sequence[str]) -> None:
        """Remove rows; keys that do not exist (or no longer do) are fine."""
        key_list = _unique(keys)
        if not key_list:
            return
        await self._bounded("delete", partition, len(key_list), lambda: self._delete(partition, key_list))

    # ------------------------------------------------------------ internals

    async def _bounded(self, op: str, partition: str, count: int, work: Callable[[], Awaitable[T]]) -> T:
        """Run one data-plane operation under the deadline, with a message that says what hung."""
        what = (
            f"{op} of {count} key(s) in partition {partition!r}"
            if count
            else f"{op} of partition {partition!r}"
        )
        if self._closed:
            raise DataPlaneError(f"{what}: this data-plane client is closed")
        timer = asyncio.timeout(self.timeout_s)
        try:
            async with timer:
                return await work()
        except TimeoutError:
            if not timer.expired():
                raise DataPlaneError(f"{what} failed: TransferQueue timed out internally") from None
            hint = self._owner_hint()
            if op == "put":
                hint += "; the rows may be partly written (a retry overwrites them, a delete removes them)"
            raise DataPlaneTimeout(
                f"{what} did not finish within {self.timeout_s:g}s: no answer from the TransferQueue "
                f"data plane at {self.endpoint}{hint}"
            ) from None
        except DataPlaneError:
            raise
        except Exception as exc:
            raise DataPlaneError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def _owner_hint(self) -> str:
        if self.addresses is not None and self.addresses.owner_alive() is False:
            return f" (its owner, pid {self.addresses.pid}, is not running)"
        return ""

    async def _retrieve(self, partition: str, keys: list[str], *, create: bool = False) -> Any:
        return await self._client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=create)

    async def _put(self, partition: str, keys: list[str], data: TensorDict, layout: codec.RowLayout) -> None:
        meta = await self._retrieve(partition, keys, create=True)
        if meta.size != len(keys):
            raise DataPlaneError(f"{partition}: controller allocated {meta.size} slots for {len(keys)} keys")
        await self._client.storage_manager.put_data(data, meta)
        if not self.verify_puts:
            return
        check = await self._retrieve(partition, keys)
        if _readable(check, len(keys), layout.fields):
            return
        problems = await self._meta_problems(partition, keys, (layout,), known_bad=True)
        details = "; ".join(f"{key}: {p.detail}" for key, p in list(problems.items())[:10])
        raise DataPlaneError(
            f"{partition}: put of {len(keys)} row(s) returned, but {len(problems) or 'some'} are not readable "
            f"({details or 'state changed during the check'}); TransferQueue refused the update "
            "(see its log, e.g. a dtype conflict with rows already in the partition)"
        )

    async def _get_settled(
        self, partition: str, keys: list[str], layouts: Sequence[codec.RowLayout]
    ) -> dict[str, Any]:
        """Read again while a concurrent write makes a read fail with every row fine on
        a second look; the caller's deadline bounds the loop."""
        while True:
            try:
                return await self._get(partition, keys, layouts)
            except _RowsChanged:
                await asyncio.sleep(_REREAD_PAUSE_S)

    async def _get(
        self, partition: str, keys: list[str], layouts: Sequence[codec.RowLayout]
    ) -> dict[str, Any]:
        meta = await self._retrieve(partition, keys)
        layout = _layout(meta.field_names, layouts)
        if _readable(meta, len(keys), layout.fields):
            try:
                return await self._read(meta, keys, layout)
            except _ReadFailure:
                pass  # find every bad key below, outside this handler
            problems = await self._data_problems(partition, keys, layouts, known_bad=True)
        else:
            problems = await self._meta_problems(partition, keys, layouts, known_bad=True)
            rest = [key for key in keys if key not in problems]
            if rest:  # name every bad key, not only those the metadata gives away
                problems.update(await self._data_problems(partition, rest, layouts))
        if problems:
            self._raise(partition, keys, problems)
        return await self._read_apart(partition, keys, layouts)

    async def _read_apart(
        self, partition: str, keys: list[str], layouts: Sequence[codec.RowLayout]
    ) -> dict[str, Any]:
        """Every row is readable, yet not all in one layout: read each layout's rows on
        their own, then put them back in the order asked."""
        by_layout: dict[str, list[str]] = {}
        for key in keys:
            meta = await self._retrieve(partition, [key])
            layout = _layout(meta.field_names, layouts)
            if not _readable(meta, 1, layout.fields):
                raise _RowsChanged(partition)
            by_layout.setdefault(layout.name, []).append(key)
        if len(by_layout) < 2:
            raise _RowsChanged(partition)  # one layout after all: a write raced the first look
        found: dict[str, Any] = {}
        for group in by_layout.values():
            meta = await self._retrieve(partition, group)
            try:
                found.update(await self._read(meta, group, _layout(meta.field_names, layouts)))
            except _ReadFailure:
                raise _RowsChanged(partition) from None
        return {key: found[key] for key in keys}

    async def _read(self, meta: Any, keys: list[str], layout: codec.RowLayout) -> dict[str, Any]:
        """Fetch ``layout``'s fields of the rows ``meta`` names and decode them, or raise ``_ReadFailure``."""
        from transfer_queue.storage import StorageKeyNotFoundError

        try:
            data = await self._client.storage_manager.get_data(meta.select_fields(list(layout.fields)))
        except StorageKeyNotFoundError as exc:
            raise _ReadFailure(
                _Problem("unreadable", f"the storage unit holds no data for it ({exc})")
            ) from None
        if data.batch_size[0] != len(keys):
            raise _ReadFailure(
                _Problem("unreadable", f"{data.batch_size[0]} rows came back for {len(keys)} keys")
            )
        try:
            records = layout.decode(keys, data)
        except codec.RowFormatError as exc:
            raise _ReadFailure(_Problem("corrupt", str(exc))) from None
        return dict(zip(keys, records, strict=True))

    async def _classify(
        self, partition: str, key: str, layouts: Sequence[codec.RowLayout]
    ) -> _Problem | None:
        meta = await self._retrieve(partition, [key])
        if meta.size == 0:
            return _Problem("absent", "no such key")
        present = set(meta.field_names)
        if not present or not bool(np.all(np.asarray(meta.production_status) == 1)):
            return _Problem("unreadable", "listed but holds no data (a put that never completed)")
        missing = [name for name in _layout(meta.field_names, layouts).fields if name not in present]
        if missing:
            return _Problem("corrupt", f"row {key!r}, field {missing[0]!r}: missing")
        return None

    async def _meta_problems(
        self, partition: str, keys: list[str], layouts: Sequence[codec.RowLayout], *, known_bad: bool = False
    ) -> dict[str, _Problem]:
        """Keys without a complete, produced row, found by bisecting metadata lookups."""
        if len(keys) == 1:
            problem = await self._classify(partition, keys[0], layouts)
            return {} if problem is None else {keys[0]: problem}
        if not known_bad:
            meta = await self._retrieve(partition, keys)
            if _readable(meta, len(keys), _layout(meta.field_names, layouts).fields):
                return {}
        first, second = _halves(keys)
        return {
            **await self._meta_problems(partition, first, layouts),
            **await self._meta_problems(partition, second, layouts),
        }

    async def _data_problems(
        self, partition: str, keys: list[str], layouts: Sequence[codec.RowLayout], *, known_bad: bool = False
    ) -> dict[str, _Problem]:
        """Keys whose data cannot be read or decoded, found by bisecting reads."""
        if not known_bad or len(keys) == 1:
            meta = await self._retrieve(partition, keys)
            layout = _layout(meta.field_names, layouts)
            if not _readable(meta, len(keys), layout.fields):
                return await self._meta_problems(partition, keys, layouts, known_bad=True)
            try:
                await self._read(meta, keys, layout)
                return {}
            except _ReadFailure as failure:
                if len(keys) == 1:
                    return {keys[0]: failure.problem}
        first, second = _halves(keys)
        return {
            **await self._data_problems(partition, first, layouts),
            **await self._data_problems(partition, second, layouts),
        }

    @staticmethod
    def _raise(partition: str, keys: list[str], problems: Mapping[str, _Problem]) -> NoReturn:
        missing = [key for key in keys if key in problems]
        corrupt = {key: p.detail for key, p in problems.items() if p.kind == "corrupt"}
        if corrupt:
            raise CorruptRows(partition, missing, corrupt)
        raise MissingRows(partition, missing)

    async def _delete(self, partition: str, keys: list[str]) -> None:
        meta = await self._retrieve(partition, keys)
        if meta.size > 0:
            await self._client.async_clear_samples(meta)


if TYPE_CHECKING:

    def _implements_the_port(plane: TransferQueueDataPlane) -> DataPlane:
        return plane  # mypy checks TransferQueueDataPlane against stages.ports.DataPlane here
