"""No orphans: whatever a tokentrail process starts dies with it, also on SIGKILL.

A process that starts others (the broker and its storage server, the vLLM engine and
its workers, a Ray cluster) calls ``guard_descendants`` first. It starts a reaper, a
small process in a session of its own, which notes the guarded process's descendants
every ``SNAPSHOT_S`` and, once the guarded process is gone, SIGKILLs every one of them
still running together with everything below them. Two more ways catch a descendant
born just before the end: a program started from then on inherits a marker in its
environment (until it rewrites its process title over it, as vLLM's processes do), and
a process forked without executing anything writes its pid to the marker's fork
registry as it starts. A SIGKILL of the guarded process therefore leaves nothing behind
after a moment, and neither does a child that ignores SIGTERM on a clean stop.

With a data directory the marker is also recorded there (``processes-ROLE.json``), so
that the next process of the same role guarding the same directory kills what an
earlier one left, should its reaper have been killed too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

MARKER_ENV = "TOKENTRAIL_OWNER"
RECORD_FILE = "processes-{role}.json"
POLL_S = 0.2
"""How often the reaper checks that the guarded process is still there."""
SNAPSHOT_S = 0.5
"""How often the reaper notes the guarded process's descendants."""
_guarded: str | None = None


def guard_descendants(data_dir: Path | None = None, role: str = "process") -> str:
    """Mark this process's future descendants and start its reaper; returns the marker.

    Call it before starting any child. Calling it again in the same process is a no-op.
    With ``data_dir``, what an earlier dead process of the same ``role`` left running
    there is killed first.
    """
    global _guarded
    if _guarded is not None:
        return _guarded
    if data_dir is not None:
        kill_leftovers(data_dir, role)
    marker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.environ[MARKER_ENV] = marker
    registry = fork_registry(marker)
    os.register_at_fork(after_in_child=lambda: _register_fork(registry))
    subprocess.Popen(
        [sys.executable, "-m", "pipeline.process.reaper", str(os.getpid()), marker],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C or a group kill does not reach it
    )
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        record = {"marker": marker, "pid": os.getpid(), "started_at": psutil.Process().create_time()}
        _write_atomically(data_dir / RECORD_FILE.format(role=role), json.dumps(record))
    _guarded = marker
    return marker


def fork_registry(marker: str) -> Path:
    """Where the forked descendants of ``marker``'s owner write their pids."""
    return Path(tempfile.gettempdir()) / f"tokentrail-{marker}.forks"


Known = dict[int, float]
"""Descendants noted while the owner lived: pid → start time (so a reused pid is not hit)."""


def descendants(pid: int) -> Known:
    """The process's descendants now, with their start times."""
    found: Known = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                found[child.pid] = child.create_time()
    return found


def owned(marker: str, known: Known | None = None) -> list[psutil.Process]:
    """Live descendants of ``marker``'s owner (this process excepted): those noted in
    ``known``, those that carry the marker, those in its fork registry, and everything
    below them."""
    roots: dict[int, psutil.Process] = {}
    for pid, created in (known or {}).items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 0.01:
                roots[pid] = process
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(MARKER_ENV) == marker:
                roots[process.pid] = process
    for pid, created in _registered(fork_registry(marker)):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 0.01:
                roots[pid] = process
    found = dict(roots)
    for process in roots.values():
        with contextlib.suppress(psutil.Error):
            found.update((child.pid, child) for child in process.children(recursive=True))
    found.pop(os.getpid(), None)
    return list(found.values())


def kill_owned(marker: str, known: Known | None = None, *, settle_s: float = 5.0) -> int:
    """SIGKILL every descendant of ``marker``'s owner until none is left (or ``settle_s``
    passed); returns how many were killed. Repeats: a dying tree may still be forking."""
    killed = 0
    deadline = time.monotonic() + settle_s
    while True:
        found = [p for p in owned(marker, known) if _running(p)]
        if not found:
            break
        for process in found:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
                killed += 1
        psutil.wait_procs(found, timeout=1.0)
        if time.monotonic() >= deadline:
            break
    fork_registry(marker).unlink(missing_ok=True)
    return killed


def kill_leftovers(data_dir: Path, role: str) -> int:
    """Kill what an earlier, dead guarded process of ``role`` in ``data_dir`` left running."""
    try:
        record = json.loads((data_dir / RECORD_FILE.format(role=role)).read_text("utf-8"))
        marker, pid, started_at = str(record["marker"]), int(record["pid"]), float(record["started_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if same_process(pid, started_at):
        return 0  # still running: its processes are its own (a lock, not this, keeps it exclusive)
    killed = kill_owned(marker)
    if killed:
        log.warning(
            "killed %d process(es) left running by an earlier process (pid %d) in %s", killed, pid, data_dir
        )
    return killed


def same_process(pid: int, started_at: float) -> bool:
    """Whether ``pid`` is still the process that started at ``started_at`` (not a reused pid)."""
    try:
        created: float = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    return abs(created - started_at) < 0.01


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text, "utf-8")
    os.replace(partial, path)


def _register_fork(registry: Path) -> None:
    """In a freshly forked child: note its pid and start time (one line, appended whole)."""
    with contextlib.suppress(OSError, psutil.Error):
        line = f"{os.getpid()} {psutil.Process().create_time()!r}\n".encode()
        fd = os.open(registry, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _registered(registry: Path) -> list[tuple[int, float]]:
    try:
        lines = registry.read_text().splitlines()
    except OSError:
        return []
    entries: list[tuple[int, float]] = []
    for line in lines:
        with contextlib.suppress(ValueError):
            pid, created = line.split()
            entries.append((int(pid), float(created)))
    return entries


def _running(process: psutil.Process) -> bool:
    try:
        status: str = process.status()
    except psutil.Error:
        return False
    return bool(status != psutil.STATUS_ZOMBIE)
