"""A gateway killed with SIGKILL mid-episode and started again continues the same session.

The gateway runs as its own process (``tokentrail gateway``) on the real broker; the
worker publishes its staged events to the same topics. After the kill, the new gateway
rebuilds its sessions from the log, so the agent's next call continues the chain and
the episode finalizes into one exact sample.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from enginekit import EngineHost, assert_sample_is_what_the_engine_saw, finalize_events, start_rig

from pipeline.auth.credentials import Credentials, Role
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import read_log
from topics.records import Record

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker]

REPO = Path(__file__).resolve().parents[2]


def start_gateway(
    worker_url: str, kafka: KafkaConfig, credentials: Path
) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "gateway",
            "--workers",
            worker_url,
            "--port",
            "0",
            "--bootstrap",
            kafka.bootstrap_servers,
            "--topic-prefix",
            kafka.names.prefix,
            "--partitions",
            str(kafka.names.partitions),
            "--credentials-dir",
            str(credentials),
            "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, "the gateway exited before serving"
    return process, json.loads(line)["url"]


def test_a_killed_gateway_restarts_into_the_same_sessions(
    host: EngineHost, model_dir: Path, kafka_config: KafkaConfig, tmp_path: Path
) -> None:
    directory = tmp_path / "credentials"
    environment = Credentials.mint(directory).authorization(Role.ENVIRONMENT)

    async def open_sink() -> KafkaEventSink:
        await ensure_topics(kafka_config)
        sink = KafkaEventSink(kafka_config)
        await sink.__aenter__()
        return sink

    sink = host.run(open_sink())
    rig = start_rig(host, model_dir, publish_to=sink)
    processes: list[subprocess.Popen[str]] = []
    try:
        process, url = start_gateway(rig.url, kafka_config, directory)
        processes.append(process)
        opened = httpx.post(
            f"{url}/rollouts", json={"rollout_id": "r-restart"}, timeout=10, headers=environment
        ).json()
        messages: list[object] = [{"role": "user", "content": "What is 2 + 3?"}]
        for question in ["And times 4?", "Thanks."]:
            agent = openai.OpenAI(
                base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, timeout=120
            )
            reply = agent.chat.completions.create(
                model="tiny", messages=messages, temperature=0, max_tokens=6
            )  # type: ignore[arg-type]
            messages += [reply.choices[0].message, {"role": "user", "content": question}]
            if question == "And times 4?":
                process.send_signal(signal.SIGKILL)  # mid-episode: between the first and second call
                process.wait(10)
                process, url = start_gateway(rig.url, kafka_config, directory)
                processes.append(process)
                opened["base_url"] = f"{url}/rollouts/r-restart/v1"
        agent = openai.OpenAI(
            base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0, timeout=120
        )
        agent.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)  # type: ignore[arg-type]
        calls = httpx.get(f"{url}/rollouts/r-restart", timeout=10, headers=environment).json()["calls"]
        assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], calls[1]["call_id"]], calls
        assert (
            httpx.post(
                f"{url}/rollouts/r-restart/seal", json={"reward": 1.0}, timeout=10, headers=environment
            ).status_code
            == 200
        )

        async def from_log() -> list[Record]:
            published: list[Record] = []
            names = kafka_config.names
            async for events, _, _ in read_log(kafka_config, [names.admission, names.staged]):
                published += [consumed.event.payload for consumed in events]
            return published

        event, sample = host.run(finalize_events(host.run(from_log()), rig.data_plane, "r-restart"))
        assert event.status == "accepted" and event.call_count == 3, event
        assert sample is not None and sample.reward == 1.0
        assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in rig.recorder.calls])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        rig.close()
        host.run(sink.__aexit__(None, None, None))
