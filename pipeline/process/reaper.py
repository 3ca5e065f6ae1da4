"""The reaper of ``guard_descendants``: ``python -m pipeline.process.reaper PID MARKER``.

While process PID (its parent) lives it notes PID's descendants; once PID is gone it
SIGKILLs them and whatever else belongs to MARKER. It imports nothing of tokentrail but
the guard, so it starts in a blink.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from pipeline.process.guard import POLL_S, SNAPSHOT_S, Known, descendants, kill_owned


def main(argv: list[str]) -> int:
    parent, marker = int(argv[0]), argv[1]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the parent's end ends the reaper
    known: Known = {}
    noted = 0.0
    while os.getppid() == parent:
        if time.monotonic() - noted >= SNAPSHOT_S:
            known.update(descendants(parent))
            noted = time.monotonic()
        time.sleep(POLL_S)
    kill_owned(marker, known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
