"""One real data directory for the inspector's tests, made once per session.

``tokentrail run`` plays a few rollouts into it (durable broker, embedded data plane, the
vLLM CPU engine) and takes one train step on them, which it records (``DATA_DIR/steps``). The run's driver seals every rollout under ``terminal`` and rarely gets
one rejected, so three more rollouts are then played on the same durable log through the
real capture core, data plane and stages, from the scenarios of
``tests/integration/test_sample_policies.py``: a rewritten history under ``chains`` (two
samples), a tree under ``terminal`` (rejected ``ambiguous_terminal``) and a tree with a
corrupted branch under all-or-nothing (rejected ``digest_mismatch``, pinned on that branch).
Their accepted samples are archived as the run archives its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from inspectkit import RunDir
from scenariokit import SCENARIOS, capture, capturing

from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import read_log
from pipeline.samples.archive import SampleArchive, archive_path, sample_record
from pipeline.stagehost.runner import serve_stage
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.specs import FINALIZER, LEDGER
from topics.records import FinalizedEvent

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--rollouts", "4", "--group-size", "2", "--turns", "2", "--max-tokens", "16"]
TRAIN = ["--train-steps", "1", "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]
"""One train step on truncated sampling: the step's report and trainer logprobs to look at."""
EXTRA = {"chains": "rewritten-chains", "ambiguous": "tree-terminal", "corrupt": "corrupt-all-or-nothing"}
"""Our rollout suffix → the scenario (``scenariokit``) it plays."""


async def _play_extra(
    config: KafkaConfig, server: EmbeddedDataPlane, run_id: str, archive: Path
) -> dict[str, dict[str, str]]:
    call_ids: dict[str, dict[str, str]] = {}
    async with (
        await TransferQueueDataPlane.attach(server.addresses, timeout_s=20.0) as plane,
        KafkaEventSink(config) as sink,
    ):
        async with capturing(plane, sink, "w-inspect") as (core, client):
            for suffix, scenario in EXTRA.items():
                rollout_id = f"{run_id}.{suffix}"
                call_ids[rollout_id] = await capture(core, client, plane, rollout_id, SCENARIOS[scenario])
        stop = asyncio.Event()
        finalizer = FinalizerStage(plane, sink)
        tasks = [
            asyncio.create_task(serve_stage(stage, spec, config, sink, stop=stop, tuning=FAST_GROUPS))
            for stage, spec in ((LedgerStage(sink, LedgerConfig()), LEDGER), (finalizer, FINALIZER))
        ]
        deadline = time.monotonic() + 120
        while any(r not in finalizer.answered for r in call_ids) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)
        keys: list[str] = []
        async for batch, _, _ in read_log(config, [config.names.finalized]):
            for item in batch:
                event = item.event.payload
                if isinstance(event, FinalizedEvent) and event.rollout_id in call_ids:
                    keys += event.sample_keys
        samples = await plane.get_samples(keys)
    with SampleArchive(archive) as out:
        for key in keys:
            out.append(sample_record(samples[key], run_id))
    return call_ids


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunDir]:
    base = tmp_path_factory.mktemp("inspect")
    data_dir = base / "tt"
    log = base / "run.log"
    with log.open("w") as err:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.cli",
                "run",
                "--json",
                *SMALL,
                *TRAIN,
                "--data-dir",
                str(data_dir),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=400,
            check=False,
        )
    assert done.returncode == 0, f"run exited {done.returncode}: {log.read_text()[-3000:]}"
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    run_id = str(summary["run_id"])
    with EmbeddedBroker(storage="durable", data_dir=data_dir) as broker, EmbeddedDataPlane.start() as server:
        call_ids = asyncio.run(_play_extra(broker.kafka_config(), server, run_id, archive_path(data_dir)))
    yield RunDir(data_dir, run_id, summary, {s: f"{run_id}.{s}" for s in EXTRA}, call_ids)


@pytest.fixture(scope="session")
def screenshots() -> Path:
    path = Path(os.environ.get("TOKENTRAIL_INSPECT_SCREENSHOTS", REPO / "tests" / "inspect" / "screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path
