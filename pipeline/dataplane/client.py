"""Build TransferQueue's ordinary async client from published addresses or from Ray.

Construction is the one blocking step of the client: the storage manager performs a
synchronous ZMQ handshake with the controller, retrying for several seconds when it is
not there. It runs on a daemon thread under our own deadline, so attaching to a dead
data plane fails within ``timeout_s`` and never delays interpreter exit.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeline.dataplane.addresses import DataPlaneAddresses, Endpoint
from stages.ports import DataPlaneError, DataPlaneTimeout

T = TypeVar("T")

STORAGE_BACKEND = "SimpleStorage"
CONTROLLER_ACTOR = "TransferQueueController"


def client_id(prefix: str = "tokentrail") -> str:
    """A client id unique per process and attach, so the data plane's logs tell clients apart."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def server_infos(addresses: DataPlaneAddresses) -> tuple[Any, dict[str, Any]]:
    """The controller's and the storage units' ``ZMQServerInfo``, as TransferQueue wants them."""
    from transfer_queue.utils.enum_utils import Role
    from transfer_queue.utils.zmq_utils import ZMQServerInfo

    def info(role: Any, endpoint: Endpoint) -> Any:
        return ZMQServerInfo(role=role, id=endpoint.id, ip=endpoint.ip, ports=dict(endpoint.ports))

    controller = info(Role.CONTROLLER, addresses.controller)
    units = {unit.id: info(Role.STORAGE, unit) for unit in addresses.storage_units}
    return controller, units


async def run_blocking(
    fn: Callable[[], T], *, timeout_s: float, what: str, discard: Callable[[T], None] | None = None
) -> T:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s`` for it.

    ``asyncio.to_thread`` would use the default executor, whose threads the interpreter
    joins at exit: a handshake stuck on a dead controller would then delay shutdown. A
    result that arrives after the caller gave up is handed to ``discard`` (to close it).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        ok, value = outcome
        if future.done():
            if ok and discard is not None:
                discard(value)
        elif ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def deliver(ok: bool, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle, (ok, value))
        except RuntimeError:  # the loop is closed: nobody waits any more
            if ok and discard is not None:
                discard(value)

    def target() -> None:
        try:
            value = fn()
        except BaseException as exc:
            deliver(False, exc)
            return
        deliver(True, value)

    threading.Thread(target=target, name=f"tokentrail-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(future, timeout_s)  # cancels ``future`` on timeout
    except TimeoutError:
        raise DataPlaneTimeout(f"{what}: no answer within {timeout_s:g}s") from None


def build_client(controller_info: Any, storage_config: Any, *, name: str | None = None) -> Any:
    """Blocking: TransferQueue's ``AsyncTransferQueueClient`` with its SimpleStorage manager."""
    from transfer_queue.client import AsyncTransferQueueClient

    client = AsyncTransferQueueClient(client_id() if name is None else name, controller_info)
    try:
        client.initialize_storage_manager(manager_type=STORAGE_BACKEND, config=storage_config)
    except BaseException:
        client.close()
        raise
    return client


async def connect(addresses: DataPlaneAddresses, *, timeout_s: float, name: str | None = None) -> Any:
    """Attach to a data plane by its published addresses; returns a ready async client."""
    controller, units = server_infos(addresses)
    try:
        return await run_blocking(
            lambda: build_client(controller, {"zmq_info": units}, name=name),
            timeout_s=timeout_s,
            what=f"attach to TransferQueue controller at {addresses.controller_address}",
            discard=close_client,
        )
    except DataPlaneTimeout as exc:
        alive = addresses.owner_alive()
        hint = f"; its owner (pid {addresses.pid}) is not running" if alive is False else ""
        raise DataPlaneTimeout(f"{exc}{hint}") from None
    except DataPlaneError:
        raise
    except Exception as exc:
        raise DataPlaneError(
            f"attach to TransferQueue controller at {addresses.controller_address} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _ray_config(ray_address: str | None, namespace: str, timeout_s: float) -> tuple[Any, bool]:
    """Blocking: join the Ray cluster if needed and read the controller's stored config.

    Also says whether this call connected to Ray (so that closing can disconnect again).
    """
    import ray

    joined = False
    if not ray.is_initialized():
        ray.init(address=ray_address or "auto", log_to_driver=False, ignore_reinit_error=True)
        joined = True
    try:
        controller = ray.get_actor(CONTROLLER_ACTOR, namespace=namespace)
    except ValueError:
        raise DataPlaneError(
            f"no {CONTROLLER_ACTOR} actor in Ray namespace {namespace!r} at {ray_address or 'auto'}; "
            "start TransferQueue there first (transfer_queue.init())"
        ) from None
    conf: Any = ray.get(controller.get_config.remote(), timeout=timeout_s)
    if conf is None:
        raise DataPlaneError(f"{CONTROLLER_ACTOR} in namespace {namespace!r} has no config yet; retry later")
    return conf, joined


@dataclass(frozen=True, slots=True)
class RayAttachment:
    """What ``connect_ray`` made: our client, the addresses, and whether it joined Ray."""

    client: Any
    addresses: DataPlaneAddresses
    joined_ray: bool

    def close(self) -> None:
        """Close the client and leave Ray if this attachment joined it; TransferQueue stays."""
        try:
            close_client(self.client)
        finally:
            if self.joined_ray:
                import ray

                ray.shutdown()


async def connect_ray(
    ray_address: str | None, *, namespace: str, timeout_s: float, name: str | None = None
) -> RayAttachment:
    """Attach to TransferQueue on a Ray cluster, the way ``transfer_queue.init()`` does for a
    second process, but with our own client (never the module-global one, whose ``close()``
    would kill the controller). The addresses let processes without Ray attach through a
    published file."""
    where = f"TransferQueue on Ray at {ray_address or 'auto'}"

    def build() -> RayAttachment:
        conf, joined = _ray_config(ray_address, namespace, timeout_s)
        backend = conf.backend.storage_backend
        if backend != STORAGE_BACKEND:
            raise DataPlaneError(
                f"{where} uses storage backend {backend!r}; tokentrail supports {STORAGE_BACKEND}"
            )
        controller_info = conf.controller.zmq_info
        units = dict(conf.backend[backend].zmq_info)
        from transfer_queue import __version__ as tq_version

        addresses = DataPlaneAddresses(
            controller=Endpoint.from_server_info(controller_info),
            storage_units=tuple(Endpoint.from_server_info(u) for u in units.values()),
            mode="ray",
            pid=None,
            transferqueue_version=str(tq_version),
        )
        return RayAttachment(build_client(controller_info, {"zmq_info": units}, name=name), addresses, joined)

    try:
        return await run_blocking(
            build, timeout_s=timeout_s, what=f"attach to {where}", discard=lambda made: made.close()
        )
    except DataPlaneError:
        raise
    except Exception as exc:
        raise DataPlaneError(f"attach to {where} failed: {type(exc).__name__}: {exc}") from exc


def close_client(client: Any) -> None:
    """Close only our client: sockets, its context and the storage manager's notify thread.

    Never ``transfer_queue.close()``: from a process that did not start TransferQueue it
    kills the controller under everyone else.
    """
    client.close()
