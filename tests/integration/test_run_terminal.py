"""``tokentrail run`` in an ordinary terminal (a pseudo-terminal of 120×40), as a person sees it.

Every byte the run writes to the terminal is fed to a terminal emulator (pyte), and the
screen is read after each chunk: the live view is on it once at most (never a second copy
scrolled up by something writing behind its back), no third party's warning and no log
line ever reaches the terminal, and at the end the screen holds the summary with the path
of the full log, which holds the run's own lines and vLLM's.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

REPO = Path(__file__).resolve().parents[2]
COLUMNS, LINES = 120, 40
SMALL = ["--rollouts", "4", "--group-size", "2", "--turns", "2", "--max-tokens", "16"]
NEVER_ON_SCREEN = (
    "Warning",
    "WARNING",
    "INFO",
    "tcmalloc",
    "Triton",
    "triton",
    "NUMA",
    '{"ts"',
    "Traceback",
)
"""Log lines (text or JSON) and the third-party noise the issue saw on the terminal."""
VIEW_ROW = "admitted"
"""A word on the live view's rollouts row and nowhere in the summary."""


def run_on_a_terminal(argv: list[str], timeout_s: float) -> tuple[int, bytes, list[list[str]]]:
    """Run ``argv`` with stdin, stdout and stderr on a pseudo-terminal; its exit code, every
    byte it wrote there, and the emulated screen after each read."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(LINES)}
    env.pop("CI", None)  # rich draws no live view when it thinks it runs in CI
    proc = subprocess.Popen(
        argv, cwd=REPO, stdin=follower, stdout=follower, stderr=follower, env=env, start_new_session=True
    )
    os.close(follower)
    screen = pyte.Screen(COLUMNS, LINES)
    stream = pyte.ByteStream(screen)
    written = bytearray()
    snapshots: list[list[str]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: every writer exited
                break
            if not chunk:
                break
            written += chunk
            stream.feed(chunk)
            snapshots.append(list(screen.display))
        else:
            raise AssertionError(
                f"the run did not finish in {timeout_s:.0f}s:\n{written.decode(errors='replace')[-3000:]}"
            )
        return proc.wait(60), bytes(written), snapshots
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def test_on_a_terminal_the_live_view_is_the_only_thing_that_moves(tmp_path: Path) -> None:
    data_dir = tmp_path / "tt"
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        *SMALL,
        "--broker-storage",
        "memory",
        "--data-dir",
        str(data_dir),
    ]
    code, written, snapshots = run_on_a_terminal(argv, timeout_s=300)
    text = written.decode(errors="replace")
    assert code == 0, text[-3000:]

    views = [sum(VIEW_ROW in line for line in snapshot) for snapshot in snapshots]
    assert max(views) == 1, "the live view was never drawn, or drawn twice on one screen"
    for word in NEVER_ON_SCREEN:
        assert word not in text, f"{word!r} reached the terminal:\n{text[-3000:]}"

    final = "\n".join(snapshots[-1])
    assert VIEW_ROW not in final  # the view is gone, the summary stays
    assert "completed" in final and "samples written" in final, final
    (log,) = (data_dir / "logs").glob("run-*.log")
    assert f"full log: {log}" in final.replace("\n", "") or str(log) in final, final
    kept = log.read_text(errors="replace")
    assert "pipeline.run" in kept and "vllm" in kept, kept[-2000:]
