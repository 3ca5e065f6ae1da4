"""``tokentrail run`` as a new user runs it on a real vocabulary: Qwen3's, with Qwen3's template.

The run plays its rollouts with an agent that knows only the openai SDK (through the
gateway), at temperature 1. Every rollout is accepted, every archived sample is a Hugging
Face forward's logprobs within 1e-4, and the run's ``retokenization`` figure is what a
decode → re-encode of its archived turns gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from enginekit import HFOracle, assert_matches_hf

from pipeline.models.tiny import make_tiny_model
from pipeline.samples.archive import read_archive, record_sample
from pipeline.samples.drift import drift_of, model_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

REPO = Path(__file__).resolve().parents[2]
TOKENTRAIL = (sys.executable, "-m", "pipeline.cli")


@pytest.mark.timeout(600)
def test_an_sdk_agent_run_on_qwen3_is_accepted_and_exact(tmp_path: Path, oracle: HFOracle) -> None:
    model_dir = make_tiny_model(tmp_path / "qwen3", vocab="qwen3")
    data_dir = tmp_path / "tt"
    log = tmp_path / "run.log"
    with log.open("w") as err:
        done = subprocess.run(
            [
                *TOKENTRAIL,
                "run",
                "--json",
                "--agent",
                "sdk",
                "--model",
                str(model_dir),
                "--data-dir",
                str(data_dir),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=540,
            check=False,
        )
    assert done.returncode == 0, f"run exited {done.returncode}; log tail:\n{log.read_text()[-4000:]}"
    summary = json.loads(done.stdout)
    assert summary["accepted"] == summary["rollouts"] == 8, summary
    archived = read_archive(data_dir / "samples.jsonl", run_id=summary["run_id"]).records
    assert len(archived) == 8
    for record in archived:
        assert_matches_hf(oracle, model_dir, record_sample(record), greedy=False)
    drift = drift_of(archived, model_tokenizer(model_dir))
    assert summary["retokenization"] == drift.document()
    assert drift.turns >= 8
