"""No orphans: a guarded process's descendants die with it, also when it is SIGKILLed.

Real processes: a parent that guards itself starts a program in a new session (as the
broker's children are) and forks a process without executing anything (as vLLM starts
its engine core), both ignoring SIGTERM as vLLM's processes did; then it is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline.process.guard import MARKER_ENV, kill_leftovers, owned

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

PARENT = f"""
import multiprocessing, signal, subprocess, sys, time
from pathlib import Path
from pipeline.process.guard import guard_descendants

def stubborn():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)

if __name__ == "__main__":
    guard_descendants(Path(sys.argv[1]), role="test")
    child = subprocess.Popen([sys.executable, "-c", {STUBBORN!r}], start_new_session=True)
    forked = multiprocessing.get_context("fork").Process(target=stubborn)
    forked.start()
    print(child.pid, forked.pid, flush=True)
    time.sleep(600)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_sigkilled_process_leaves_no_descendant(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    executed, forked = (int(pid) for pid in parent.stdout.readline().split())
    record = json.loads((tmp_path / "processes-test.json").read_text())
    assert record["pid"] == parent.pid
    deadline = time.monotonic() + 10  # the forked child registers itself as it starts
    while not {executed, forked} <= {p.pid for p in owned(record["marker"])}:
        assert time.monotonic() < deadline, "the guard does not see both descendants"
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone_within(executed, 10), "a program it started outlived its SIGKILLed ancestor"
    assert _gone_within(forked, 10), "a process it forked outlived its SIGKILLed ancestor"
    assert _gone_within_owned(record["marker"], 10)


def _gone_within_owned(marker: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while owned(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_leftovers_of_a_dead_process_are_killed_at_the_next_start(tmp_path: Path) -> None:
    """Even when the reaper itself was killed: the record in the data dir names them."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    marker = "test-leftover"
    (tmp_path / "processes-test.json").write_text(
        json.dumps({"marker": marker, "pid": int(gone.stdout), "started_at": 1.0})
    )
    leftover = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], env={**os.environ, MARKER_ENV: marker}, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 10
        while not owned(marker) and time.monotonic() < deadline:  # its environment is readable once it runs
            time.sleep(0.05)
        assert kill_leftovers(tmp_path, "test") == 1
        assert _gone_within(leftover.pid, 10)
    finally:
        if leftover.poll() is None:
            leftover.kill()


def test_a_live_owner_keeps_its_processes(tmp_path: Path) -> None:
    marker = "test-live-owner"
    me = psutil.Process()
    (tmp_path / "processes-test.json").write_text(
        json.dumps({"marker": marker, "pid": me.pid, "started_at": me.create_time()})
    )
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], env={**os.environ, MARKER_ENV: marker})
    try:
        assert kill_leftovers(tmp_path, "test") == 0
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
