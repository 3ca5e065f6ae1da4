"""The typed failure a capture step raises; the call is still served, its capture fails."""

from __future__ import annotations

from topics.failures import WorkerFailure


class CaptureFailure(Exception):
    """Capture of one call failed with a DESIGN §6 worker code."""

    def __init__(self, code: WorkerFailure, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail
