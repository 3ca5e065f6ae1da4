"""The vLLM worker process: vLLM's OpenAI and Anthropic serving layers with token capture.

``pipeline.worker.serving`` builds vLLM's handlers on the capturing engine client and
renderer; ``pipeline.worker.routes`` serves them with capture opened before and commit
coordinates attached after; ``pipeline.worker.server.create_app`` adds refit admin,
health and metrics around a ``stages.capture.vllm.worker.VllmWorker``;
``pipeline.worker.main`` wires engine, ports and an in-loop uvicorn server
(``run_worker``, ``WorkerServer``). Only the flag types are imported here, so the CLI
stays fast to load.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.process.flags import Flag

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
"""Largest request body a worker accepts (``--max-body-bytes``); a long agentic chat is
well under a megabyte of JSON. Bigger bodies are answered 413 before they are read."""

MaxBodyBytes = Annotated[
    int,
    Field(
        ge=1,
        description=f"larger request bodies are answered 413 before they are read (default: {DEFAULT_MAX_BODY_BYTES}, 8 MiB)",
    ),
    Flag(metavar="N"),
]
"""``--max-body-bytes``, the same on every HTTP verb (worker, gateway)."""
