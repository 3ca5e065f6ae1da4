"""An embedded data plane: TransferQueue's controller and one storage unit in this process.

TransferQueue normally starts both as Ray actors, which on a small machine costs 9–20 s
and about 2 GB before the first row moves (DESIGN §3). Both actor classes wrap plain
Python classes that run their own ZMQ server threads, so this module constructs those
classes directly: about 0.5 s once imported, no Ray runtime at all (a standalone
``tokentrail dataplane`` process idles at about 450 MiB resident, torch and Ray imports
included). Rows still move over the same ZMQ sockets, so any other process attaches with
the ordinary TransferQueue client, given the addresses this process publishes.

This leans on TransferQueue and Ray internals (pinned: transferqueue 0.1.11, ray 2.60):

- ``ActorClass.__ray_metadata__.modified_class.__ray_actor_class__`` is the undecorated
  class of a ``@ray.remote`` class;
- ``TransferQueueController()`` and ``SimpleStorageUnit(config)`` bind and start their
  server threads in ``__init__``, choosing their host with the module-level
  ``get_node_ip_address`` of ``transfer_queue.controller`` and
  ``transfer_queue.storage.simple_storage`` (replaced during construction, to bind loopback);
- the controller has no shutdown method: terminating its ZMQ context ends its two
  threads (``wait_connection_thread``, ``process_request_thread``), after which its
  sockets (``handshake_socket``, ``request_handle_socket``) can be closed;
- the controller's ``index_manager`` (a ``PartitionIndexManager``) hands out row slots
  (global indexes) and takes freed ones back through ``release_indexes`` and
  ``release_partition`` into ``reusable_indexes``, from which ``allocate_indexes`` takes
  first. Here a freed slot is held back ``SLOT_REUSE_AFTER_S`` first (``held_slot_manager``).

Why slots are held back: a delete is a lookup (key to slot) and then a clear of that slot,
and one row has several deleters (the finalizer, the worker once its rollout is finalized,
the janitor). A deleter that looked up before another deleted would clear the slot after
it was handed to a new row, deleting a live rollout's row before the finalizer read it.
Every client's lookup and clear run under its deadline, which stays below the hold
(``pipeline.dataplane.transferqueue``), so a late clear finds its slot still empty.

``tests/integration/test_dataplane.py`` fails loudly when any of this changes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.dataplane.addresses import DataPlaneAddresses, Endpoint, remove_if_owned
from pipeline.dataplane.client import run_blocking
from pipeline.dataplane.config import (
    ADDRESSES_FILE_NAME,
    DEFAULT_HOST,
    DEFAULT_TIMEOUT_S,
    SLOT_REUSE_AFTER_S,
    is_loopback,
)
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from stages.ports import SAMPLES_PARTITION, STAGING_PARTITION, DataPlaneError

TESTED_TRANSFERQUEUE_VERSION = "0.1.11"
START_TIMEOUT_S = 120.0  # includes importing torch, Ray and TransferQueue on a cold start
_THREAD_JOIN_S = 5.0


class EmbeddedStartError(DataPlaneError):
    """The in-process controller or storage unit could not be built (TransferQueue changed?)."""


def actor_class(remote_class: Any) -> type:
    """The plain Python class behind a ``@ray.remote`` class."""
    try:
        cls = remote_class.__ray_metadata__.modified_class.__ray_actor_class__
    except AttributeError as exc:
        raise EmbeddedStartError(
            f"cannot unwrap Ray actor class {remote_class!r} ({exc}); the in-process data plane "
            f"is tested with transferqueue=={TESTED_TRANSFERQUEUE_VERSION} and its pinned Ray"
        ) from None
    if not isinstance(cls, type):
        raise EmbeddedStartError(f"{remote_class!r} does not wrap a class")
    return cls


@contextlib.contextmanager
def _bound_to(host: str) -> Iterator[None]:
    """Make the controller and storage unit bind ``host`` instead of asking Ray for the node IP."""
    import transfer_queue.controller as controller_module
    import transfer_queue.storage.simple_storage as storage_module

    modules = (controller_module, storage_module)
    saved = []
    for module in modules:
        if not hasattr(module, "get_node_ip_address"):
            raise EmbeddedStartError(
                f"{module.__name__}.get_node_ip_address is gone; the in-process data plane is tested "
                f"with transferqueue=={TESTED_TRANSFERQUEUE_VERSION}"
            )
        saved.append(module.get_node_ip_address)
        module.get_node_ip_address = lambda: host
    try:
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.get_node_ip_address = original


_hook_lock = threading.Lock()
_hook_installed = False


def _quiet_controller_shutdown() -> None:
    """Terminating the controller's context ends its handshake thread with an uncaught
    ``ContextTerminated``; that is the intended way out, so keep it off stderr."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        import zmq

        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            name = args.thread.name if args.thread is not None else ""
            if args.exc_type is zmq.ContextTerminated and name.startswith("TransferQueueController"):
                return
            previous(args)

        threading.excepthook = hook
        _hook_installed = True


def _stop_controller(controller: Any) -> None:
    """End the controller's threads and release its ports (it has no shutdown of its own).

    Terminating its ZMQ context wakes both threads with ``ContextTerminated``; ``term()``
    then blocks until every socket is closed, which is safe to do here only once the
    threads that own them have exited, hence the terminator thread and the joins.
    """
    _quiet_controller_shutdown()
    terminator = threading.Thread(
        target=controller.zmq_context.term, name="tokentrail-dataplane-term", daemon=True
    )
    terminator.start()
    for name in ("wait_connection_thread", "process_request_thread"):
        thread = getattr(controller, name, None)
        if thread is not None:
            thread.join(_THREAD_JOIN_S)
    for name in ("handshake_socket", "request_handle_socket"):
        sock = getattr(controller, name, None)
        if sock is not None and not sock.closed:
            sock.close(linger=0)
    terminator.join(_THREAD_JOIN_S)


class EmbeddedDataPlane:
    """A TransferQueue controller plus one storage unit owned by this process.

    Only the owner stops it (``stop``, or leaving the ``with`` block); attached clients
    merely disconnect. Start with ``EmbeddedDataPlane.start()``.
    """

    def __init__(self, controller: Any, storage_unit: Any, addresses: DataPlaneAddresses) -> None:
        self._controller = controller
        self._storage_unit = storage_unit
        self.addresses = addresses
        self._published: list[Path] = []
        self._lock = threading.Lock()
        self._stopped = False

    @classmethod
    def start(cls, *, host: str = DEFAULT_HOST, storage_capacity: int | None = None) -> EmbeddedDataPlane:
        """Blocking (about 0.5 s once imports are warm): build, bind to ``host``, serve."""
        if not is_loopback(host):
            raise ValueError(f"host: an embedded data plane binds loopback only, got {host!r}")
        import transfer_queue
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        controller_cls = actor_class(TransferQueueController)
        storage_cls = actor_class(SimpleStorageUnit)
        config = {"total_storage_size": storage_capacity, "num_data_storage_units": 1}
        try:
            with _bound_to(host):
                controller = controller_cls()
                controller.index_manager = held_slot_manager(SLOT_REUSE_AFTER_S)
                try:
                    storage_unit = storage_cls(config)
                except BaseException:
                    _stop_controller(controller)
                    raise
        except EmbeddedStartError:
            raise
        except Exception as exc:
            raise EmbeddedStartError(
                f"in-process TransferQueue failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            addresses = DataPlaneAddresses(
                controller=Endpoint.from_server_info(controller.zmq_server_info),
                storage_units=(Endpoint.from_server_info(storage_unit.zmq_server_info),),
                mode="embedded",
                pid=os.getpid(),
                transferqueue_version=str(transfer_queue.__version__),
            )
            for endpoint in (addresses.controller, *addresses.storage_units):
                if endpoint.ip != host:
                    raise EmbeddedStartError(f"{endpoint.id} bound {endpoint.ip}, not {host}")
        except BaseException:
            storage_unit.shutdown()
            _stop_controller(controller)
            raise
        return cls(controller, storage_unit, addresses)

    @property
    def running(self) -> bool:
        return not self._stopped

    @property
    def published(self) -> tuple[Path, ...]:
        """The address files this owner wrote (and will remove on ``stop``)."""
        return tuple(self._published)

    def publish(self, path: Path) -> Path:
        """Write the addresses file for local attachers; ``stop`` removes it again."""
        if self._stopped:
            raise DataPlaneError("publish: the embedded data plane is stopped")
        self.addresses.write(path)
        self._published.append(path)
        return path

    def stop(self) -> None:
        """Stop serving and release the ports (idempotent). Attached clients then time out."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for path in self._published:
            remove_if_owned(path, os.getpid())
        try:
            self._storage_unit.shutdown()
        finally:
            _stop_controller(self._controller)

    def __enter__(self) -> EmbeddedDataPlane:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def held_slot_manager(hold_s: float, clock: Callable[[], float] = time.monotonic) -> Any:
    """TransferQueue's slot manager, holding each freed slot back ``hold_s`` before reuse
    (the module's docstring says why). Runs on the controller's request thread only."""
    from transfer_queue.controller import PartitionIndexManager

    class HeldSlots(PartitionIndexManager):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.held: collections.deque[tuple[float, list[int]]] = collections.deque()
            """Freed slots, oldest first, each batch with the time it may be reused."""

        def allocate_indexes(self, partition_id: str, count: int = 1) -> list[int]:
            now = clock()
            while self.held and self.held[0][0] <= now:
                self.reusable_indexes.extend(self.held.popleft()[1])
            indexes: list[int] = super().allocate_indexes(partition_id, count)
            return indexes

        def release_indexes(self, partition_id: str, indexes_to_release: list[int]) -> Any:
            return self._hold(
                lambda: super(HeldSlots, self).release_indexes(partition_id, indexes_to_release)
            )

        def release_partition(self, partition_id: str) -> Any:
            return self._hold(lambda: super(HeldSlots, self).release_partition(partition_id))

        def _hold(self, release: Callable[[], Any]) -> Any:
            ripe = len(self.reusable_indexes)
            released = release()
            freed = self.reusable_indexes[ripe:]
            del self.reusable_indexes[ripe:]
            if freed:
                self.held.append((clock() + hold_s, freed))
            return released

    return HeldSlots()


async def start_embedded(
    *, host: str = DEFAULT_HOST, storage_capacity: int | None = None, timeout_s: float = START_TIMEOUT_S
) -> EmbeddedDataPlane:
    """``EmbeddedDataPlane.start`` off the event loop, bounded by ``timeout_s``."""
    return await run_blocking(
        lambda: EmbeddedDataPlane.start(host=host, storage_capacity=storage_capacity),
        timeout_s=timeout_s,
        what="start the embedded data plane",
        discard=lambda server: server.stop(),
    )


@contextlib.asynccontextmanager
async def embedded_data_plane(
    data_dir: Path | None = None,
    *,
    addresses_file: Path | None = None,
    host: str = DEFAULT_HOST,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    staging_partition: str = STAGING_PARTITION,
    samples_partition: str = SAMPLES_PARTITION,
) -> AsyncIterator[TransferQueueDataPlane]:
    """Start an embedded data plane, attach a client to it, and stop both on exit.

    With ``data_dir`` (or an explicit ``addresses_file``) the addresses are published to
    ``data_dir/dataplane.json`` for other processes, and removed again on exit;
    ``plane.addresses`` holds them either way (``to_json()`` for an environment variable).
    """
    target = (
        addresses_file
        if addresses_file is not None
        else None
        if data_dir is None
        else data_dir / ADDRESSES_FILE_NAME
    )
    server = await start_embedded(host=host)
    try:
        if target is not None:
            server.publish(target)
        plane = await TransferQueueDataPlane.attach(
            server.addresses,
            timeout_s=timeout_s,
            staging_partition=staging_partition,
            samples_partition=samples_partition,
        )
        try:
            yield plane
        finally:
            await plane.close()
    finally:
        await asyncio.to_thread(server.stop)
