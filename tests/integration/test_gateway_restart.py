"""A gateway killed with SIGKILL mid-episode continues the same session: restarted, or on
another replica.

The gateway runs as its own process (``tokentrail gateway``) on the real broker; the
worker publishes its staged events to the same topics. After the kill, the new gateway
rebuilds its sessions from the log (a replica: the one session it is called for), so the
agent's next call continues the chain and the episode finalizes into one exact sample.
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
    worker_url: str, kafka: KafkaConfig, credentials: Path, *extra: str
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
            *extra,
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


async def from_log(kafka: KafkaConfig) -> list[Record]:
    published: list[Record] = []
    names = kafka.names
    async for events, _, _ in read_log(kafka, [names.admission, names.staged]):
        published += [consumed.event.payload for consumed in events]
    return published


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

        event, sample = host.run(
            finalize_events(host.run(from_log(kafka_config)), rig.data_plane, "r-restart")
        )
        assert event.status == "accepted" and event.call_count == 3, event
        assert sample is not None and sample.reward == 1.0
        episode = rig.recorder.calls[:3]  # the fresh rollout's call came last
        assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in episode])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        rig.close()
        host.run(sink.__aexit__(None, None, None))


def test_a_replica_killed_mid_episode_leaves_the_episode_to_another(
    host: EngineHost, model_dir: Path, kafka_config: KafkaConfig, tmp_path: Path
) -> None:
    """Two replicas behind one address (the test routes as a proxy would after a failure):
    the rollout is opened and first called on one, which is then SIGKILLed; the other
    takes the session over from the log, with the same agent key, and the episode's calls,
    its look and its seal all work there, into one exact sample."""
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
        first, first_url = start_gateway(rig.url, kafka_config, directory, "--replica", "a")
        second, second_url = start_gateway(rig.url, kafka_config, directory, "--replica", "b")
        processes += [first, second]
        opened = httpx.post(
            f"{first_url}/rollouts",
            json={"rollout_id": "r-replica", "group_id": "g"},
            timeout=10,
            headers=environment,
        ).json()
        assert opened["base_url"] == f"{first_url}/rollouts/r-replica/v1"
        fresh = httpx.post(  # opened on the first replica, called first on the second
            f"{first_url}/rollouts",
            json={"rollout_id": "r-fresh", "history": "render"},
            timeout=10,
            headers=environment,
        ).json()
        messages: list[object] = [{"role": "user", "content": "What is 2 + 3?"}]
        for url, question in [(first_url, "And times 4?"), (second_url, "Thanks.")]:
            agent = openai.OpenAI(
                base_url=f"{url}/rollouts/r-replica/v1", api_key=opened["api_key"], max_retries=0, timeout=120
            )
            reply = agent.chat.completions.create(
                model="tiny", messages=messages, temperature=0, max_tokens=6
            )  # type: ignore[arg-type]
            messages += [reply.choices[0].message, {"role": "user", "content": question}]
            if url == first_url:
                first.send_signal(signal.SIGKILL)  # mid-episode: between the first and second call
                first.wait(10)
        agent = openai.OpenAI(
            base_url=f"{second_url}/rollouts/r-replica/v1",
            api_key=opened["api_key"],
            max_retries=0,
            timeout=120,
        )
        agent.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)  # type: ignore[arg-type]
        agent = openai.OpenAI(
            base_url=f"{second_url}/rollouts/r-fresh/v1", api_key=fresh["api_key"], max_retries=0, timeout=120
        )
        agent.chat.completions.create(model="tiny", messages=messages[:1], temperature=0, max_tokens=2)  # type: ignore[arg-type]
        assert (
            httpx.get(f"{second_url}/rollouts/r-fresh", timeout=10, headers=environment).json()["history"]
            == "render"
        )
        shown = httpx.get(f"{second_url}/rollouts/r-replica", timeout=10, headers=environment).json()
        calls = shown["calls"]
        assert shown["group_id"] == "g"
        assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], calls[1]["call_id"]], calls
        sealed = httpx.post(
            f"{second_url}/rollouts/r-replica/seal", json={"reward": 1.0}, timeout=10, headers=environment
        )
        assert sealed.status_code == 200, sealed.text
        health = httpx.get(f"{second_url}/metrics", timeout=10).text
        assert "tokentrail_gateway_taken_over_total 2.0" in health, health

        event, sample = host.run(
            finalize_events(host.run(from_log(kafka_config)), rig.data_plane, "r-replica")
        )
        assert event.status == "accepted" and event.call_count == 3, event
        assert sample is not None and sample.reward == 1.0 and sample.group_id == "g"
        episode = rig.recorder.calls[:3]  # the fresh rollout's call came last
        assert_sample_is_what_the_engine_saw(sample, [(call, 0) for call in episode])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        rig.close()
        host.run(sink.__aexit__(None, None, None))
