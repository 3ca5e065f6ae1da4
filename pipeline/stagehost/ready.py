"""``--ready-fd``: a stage process tells the process that started it that it serves."""

from __future__ import annotations

import asyncio
import contextlib
import os


class ReadyNotice:
    """One line to the parent once the group first assigned this member.

    Only the first assignment is announced: a parent waits for it once, and a stage
    started again after an outage is the same member to it."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_inheritable(fd, False)  # for this process only, not for anything it starts

    async def announce_when(self, started: asyncio.Event) -> None:
        await started.wait()
        if self.fd is not None:
            with contextlib.suppress(OSError):  # the parent stopped listening: nothing to tell
                os.write(self.fd, b"ready\n")
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
