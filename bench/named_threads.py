"""Run a module (``tokentrail dataplane``) with TransferQueue's threads named for the kernel.

``tokentrail dataplane`` hosts TransferQueue's controller and its storage unit in one
process, each serving from threads of its own. Python 3.11 names threads for itself
only, so to the kernel every one of them is ``python`` and ``/proc`` cannot tell the
controller's CPU from the storage unit's. Here a thread copies a role onto each new
thread's kernel name (``/proc/self/task/TID/comm``, writable within a process), so that
``bench.common.thread_cpu_s`` splits the process's CPU by role from outside:

- ``tq-ctl-request``: the controller's one request thread, which serves every metadata
  request in turn (its ceiling is one core); ``tq-ctl-wait``: its handshake thread;
- ``tq-ctl-zmq``: the ZMQ threads of the controller's context, ``tq-su-zmq``: those of
  the storage unit's. ZMQ's own threads carry no Python name; the controller's context
  is the first one the process opens (``EmbeddedDataPlane.start`` builds the controller
  first) and the kernel numbers threads upwards, so ZMQ threads numbered below the
  controller's request thread are the controller's;
- ``tq-su-*``: the storage unit's worker, proxy and disk pools.

    python -m bench.named_threads pipeline.cli dataplane --data-dir DIR --json
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

CONTROLLER = "tq-ctl-"
STORAGE = "tq-su-"
REQUEST_THREAD = f"{CONTROLLER}request"
ROLES = (
    ("TransferQueueControllerProcessRequestThread", REQUEST_THREAD),
    ("TransferQueueControllerWaitConnectionThread", f"{CONTROLLER}wait"),
    ("StorageUnitWorkerThread", f"{STORAGE}worker"),
    ("StorageUnitProxyThread", f"{STORAGE}proxy"),
    ("tq-ssd-", f"{STORAGE}disk"),
)
ZMQ_PREFIX = "ZMQbg/"
LABELLER = "thread-names"
POLL_S = 0.2


def role(python_name: str) -> str | None:
    """The kernel name for a Python thread of TransferQueue's, or None for any other thread."""
    for prefix, label in ROLES:
        if python_name.startswith(prefix):
            return label
    return None


def zmq_role(tid: int, request_tid: int) -> str:
    """The kernel name of a ZMQ thread: the controller's if the kernel numbered it before
    the controller's request thread (see the module's docstring)."""
    return f"{CONTROLLER}zmq" if tid < request_tid else f"{STORAGE}zmq"


def _rename(tid: int, name: str) -> None:
    with contextlib.suppress(OSError):  # the thread ended meanwhile
        Path(f"/proc/self/task/{tid}/comm").write_text(name)


def _label_once(done: set[int]) -> None:
    """Name every thread not named yet; ZMQ threads once the request thread is known."""
    python = {thread.native_id: thread.name for thread in threading.enumerate()}
    request_tid = next((tid for tid, name in python.items() if role(name) == REQUEST_THREAD), None)
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        if tid in done:
            continue
        name = python.get(tid)
        label = role(name) if name is not None else None
        if label is None and name is None and request_tid is not None:
            try:
                kernel_name = (task / "comm").read_text()
            except OSError:
                continue
            label = zmq_role(tid, request_tid) if kernel_name.startswith(ZMQ_PREFIX) else None
        if label is not None:
            _rename(tid, label)
            done.add(tid)


def _label_forever() -> None:
    _rename(threading.get_native_id(), LABELLER)
    done: set[int] = set()
    while True:
        _label_once(done)
        time.sleep(POLL_S)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m MODULE ARGS...`` (``argv`` = MODULE, ARGS...) with the labeller beside it.
    The module is named on the command line, as for ``python -m``: the benchmarks sit below
    the CLI in the house and do not import it."""
    module, *args = sys.argv[1:] if argv is None else argv
    sys.argv = [module, *args]
    threading.Thread(target=_label_forever, name=LABELLER, daemon=True).start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
