"""How a benchmark's child process (the load generator, the sample owner) runs and fails."""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from collections.abc import Coroutine
from typing import Any


def run_child(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main``; on any failure print it and exit at once with 1, since TransferQueue's
    client threads are not daemons and would keep a failed child alive, hiding the failure."""
    try:
        asyncio.run(main)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
