"""``tokentrail run`` end to end, as a user runs it: a subprocess on the embedded defaults.

Each run starts the durable tansu broker, the embedded TransferQueue, a vLLM CPU engine
on the tiny model, both stages and the driver, so every test here costs about a minute
of engine start-up. The first test runs twice on one data directory, with stage processes
and then with the stages in process (the second run must continue the same log and
finalize only its own rollouts; it is then kept serving, and the credentials it hands out
are checked); the second plays through a gateway with an SDK agent and trains the policy
on its samples (``--train-steps``); the third interrupts a run with SIGINT and checks that
nothing it started is left running; the fourth kills a stage process and checks that the
run reports it as its failure; the fifth trains with TRL's GRPOTrainer (``--trainer trl``),
on policy; the sixth lets generation run ahead of a deliberately slow trainer, paced; the seventh
paces TRL the same way; the eighth serves a model whose generation config carries sampling
defaults. The training runs
sample with truncation (temperature 0.7, top-p 0.8, top-k 20) and check that both
trainers replay it and report the mismatch of every step.
"""

from __future__ import annotations

import contextlib
import json
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--rollouts", "4", "--group-size", "2", "--turns", "2", "--max-tokens", "16"]
FINALIZED_TOPIC = "tokentrail.finalized"
STAGE_GROUPS = ("tokentrail-ledger", "tokentrail-finalizer")
TRUNCATED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
TRUNCATED_FLAGS = ["--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]
MISMATCH_METRICS = {
    "tokens", "k1", "k3", "log_ppl_diff", "chi2_token", "chi2_sequence", "ess_token", "ess_sequence",
    "ratio_min", "ratio_mean", "ratio_p99", "ratio_max", "max_abs_dev", "corrections", "buckets", "worst",
    "provenance_unknown_tokens", "not_replayed_tokens", "unreplayable_samples", "mean_log_kept",
}  # fmt: skip


def tokentrail(*args: str, timeout: float, stderr: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_small(data_dir: Path, log: Path, *extra: str) -> dict[str, Any]:
    with log.open("w") as err:
        done = tokentrail(
            "run", "--json", *SMALL, *extra, "--data-dir", str(data_dir), timeout=300, stderr=err
        )
    assert done.returncode == 0, f"run exited {done.returncode}; log tail:\n{log.read_text()[-4000:]}"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one document, got: {done.stdout!r}"
    summary: dict[str, Any] = json.loads(lines[0])
    return summary


def export(data_dir: Path, *extra: str) -> list[dict[str, Any]]:
    done = tokentrail(
        "samples", "export", "--data-dir", str(data_dir), "--format", "jsonl", *extra, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def check_mismatch(step: dict[str, Any]) -> dict[str, Any]:
    """A step's mismatch report has every metric and bucket; returns it."""
    mismatch: dict[str, Any] = step["mismatch"]
    assert mismatch.keys() >= MISMATCH_METRICS, sorted(mismatch)
    assert {"clean", "straddled", "lag", "turn", "after_tool", "later"} == mismatch["buckets"].keys()
    assert set(mismatch["corrections"]) == {"token", "sequence", "geometric"}
    assert mismatch["worst"] and {"sample_key", "call_id", "turn", "position", "rank", "log_kept"} <= set(
        mismatch["worst"][0]
    )
    assert mismatch["tokens"] > 0 and mismatch["unreplayable_samples"] == 0
    assert mismatch["provenance_unknown_tokens"] == 0  # every call records it, neutral ones too
    return mismatch


def mismatch_offline(data_dir: Path, model: Path, *extra: str) -> dict[str, Any]:
    """``tokentrail mismatch`` over the run's export."""
    path = data_dir / "export.jsonl"
    done = tokentrail("samples", "export", "--data-dir", str(data_dir), "--out", str(path), timeout=60)
    assert done.returncode == 0, done.stderr
    done = tokentrail("mismatch", str(path), "--model", str(model), *extra, timeout=120)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def check_summary(summary: dict[str, Any], data_dir: Path) -> None:
    assert summary["status"] == "completed", summary
    assert summary["rollouts"] == 4
    assert summary["finalized"] == 4 and summary["missing"] == 0
    assert summary["accepted"] + sum(summary["rejected"].values()) == 4
    assert all(reason and count > 0 for reason, count in summary["rejected"].items())
    assert summary["lag"] == 0 and set(summary["lag_by_stage"]) == {"ledger", "finalizer"}
    assert all(value == 0 for value in summary["lag_by_stage"].values())
    assert summary["calls"] >= 4  # at least one call per rollout, at most --turns
    assert summary["temperature"] == 1.0
    assert summary["samples_written"] == summary["accepted"]
    assert Path(summary["data_dir"]) == data_dir
    assert Path(summary["samples_file"]) == data_dir / "samples.jsonl"
    assert Path(summary["model_dir"]) == data_dir / "tiny-model"


def check_sample(sample: dict[str, Any]) -> None:
    n = len(sample["token_ids"])
    assert n > 0
    assert len(sample["token_mask"]) == len(sample["logprobs"]) == len(sample["weight_versions"]) == n
    assert set(sample["token_mask"]) <= {0.0, 1.0} and 1.0 in sample["token_mask"]
    assert all(lp == 0.0 for lp, m in zip(sample["logprobs"], sample["token_mask"], strict=True) if m == 0.0)
    assert all(lp <= 0.0 for lp in sample["logprobs"])
    assert "reward" in sample and isinstance(sample["reward"], float)
    assert sample["rollout_id"].startswith(sample["run_id"] + ".")
    assert sample["group_id"] is not None and sample["rollout_id"].startswith(sample["group_id"] + ".")
    covered = sum(span["carry_len"] + span["gen_len"] for span in sample["spans"])
    assert covered == n


@pytest.mark.timeout(600)
def test_two_runs_on_one_data_dir_finalize_each_rollout_once(tmp_path: Path) -> None:
    data_dir = tmp_path / "tt"
    first = run_small(data_dir, tmp_path / "run1.log")
    check_summary(first, data_dir)
    assert first["stages"] == "processes"
    samples = export(data_dir)
    assert len(samples) == first["accepted"]
    for sample in samples:
        check_sample(sample)
        assert sample["run_id"] == first["run_id"]
    assert sum(len(s["token_ids"]) for s in samples) == first["tokens_captured"]
    groups = Counter(s["group_id"] for s in samples)
    assert len(groups) <= 2 and all(count <= 2 for count in groups.values())

    # The same groups, in process, and then kept serving: it names the operator's credential
    # file (never a secret) in serving.json, and the worker checks it.
    with kept_run(data_dir, tmp_path / "run2.log", "--stages", "inline") as (second, serving):
        check_the_credentials_a_kept_run_hands_out(data_dir, serving)
        # Kafka's own client library reads what the run wrote, not only aiokafka.
        finalized, lag = librdkafka_view(serving["bootstrap"], STAGE_GROUPS)
        assert lag == dict.fromkeys(STAGE_GROUPS, 0), lag
        ids = Counter(event["rollout_id"] for event in finalized)
        assert all(count == 1 for count in ids.values()), ids
        assert {
            run: sum(1 for i in ids if i.startswith(run + ".")) for run in (first["run_id"], second["run_id"])
        } == {
            first["run_id"]: first["rollouts"],
            second["run_id"]: second["rollouts"],
        }
    check_summary(second, data_dir)
    assert second["stages"] == "inline"
    assert second["run_id"] != first["run_id"]

    # The archive itself, not the (deduplicating) export: every rollout once.
    archived = [json.loads(line) for line in (data_dir / "samples.jsonl").read_text().splitlines()]
    ids = Counter(record["rollout_id"] for record in archived)
    assert all(count == 1 for count in ids.values()), ids
    runs = Counter(record["run_id"] for record in archived)
    assert runs == {first["run_id"]: first["accepted"], second["run_id"]: second["accepted"]}
    assert len(export(data_dir)) == first["accepted"] + second["accepted"]
    only_second = export(data_dir, "--run", second["run_id"])
    assert {s["rollout_id"] for s in only_second} == {
        r["rollout_id"] for r in archived if r["run_id"] == second["run_id"]
    }


@pytest.mark.timeout(400)
def test_an_sdk_agent_trains_the_policy_through_the_gateway(tmp_path: Path) -> None:
    """The agent uses only the openai SDK (the gateway admits, seals and strips), and
    ``--train-steps`` closes the loop: rollouts -> samples -> a GRPO step -> new weights in
    the worker, twice. Sampled at temperature 0.7, top-p 0.8, top-k 20 (top-k reaches vLLM
    as an SDK extra): every span records them, the trainer replays them (on policy to 1e-4),
    and ``tokentrail mismatch`` shows the log S bias a trainer that ignores them would have."""
    data_dir = tmp_path / "tt"
    summary = run_small(  # stages in process: the stage processes are covered by the other runs
        data_dir,
        tmp_path / "run.log",
        *("--agent", "sdk", "--train-steps", "2", "--broker-storage", "memory", "--stages", "inline"),
        *TRUNCATED_FLAGS,
    )
    assert summary["status"] == "completed" and summary["lag"] == 0, summary
    assert summary["agent"] == "sdk" and summary["gateway_url"].startswith("http://127.0.0.1:")
    assert summary["rollouts"] == summary["finalized"] == summary["accepted"] == 8, summary
    first, second = summary["train_steps"]
    assert [first["step"], second["step"]] == [1, 2]
    assert [first["weight_version"], second["weight_version"]] == [0, 1]
    assert first["samples"] == second["samples"] == 4
    # The trainer recomputes the logprobs the worker sampled with, before and after a refit
    # that moved the policy by far more than that: the worker really serves the new weights.
    assert first["ratio_max_abs_dev"] <= 1e-4 and second["ratio_max_abs_dev"] <= 1e-4, summary["train_steps"]
    assert first["update_norm"] > 0 and first["policy_shift"] > 100 * second["ratio_max_abs_dev"]
    for step in (first, second):
        mismatch = check_mismatch(step)
        assert mismatch["mean_log_kept"] < 0
        assert abs(mismatch["k1"]) < 1e-5 and set(mismatch["buckets"]["lag"]) == {"0"}
    assert summary["dataplane_samples_left"] == 0
    samples = export(data_dir)
    for sample in samples:
        check_sample(sample)
        assert all(span["sampling"] == TRUNCATED for span in sample["spans"]), sample["spans"]
    versions = Counter(frozenset(sample["weight_versions"]) for sample in samples)
    assert versions == {frozenset({0}): 4, frozenset({1}): 4}
    assert (data_dir / "weights" / "step-2" / "config.json").is_file()
    # Offline, the step-0 samples against the model they were sampled from: replayed, on
    # policy; with the temperature alone, every ratio is off by the kept mass.
    model = data_dir / "tiny-model"
    replayed = mismatch_offline(data_dir, model, "--policy-version", "0")["buckets"]["lag"]["0"]
    ignored = mismatch_offline(data_dir, model, "--policy-version", "0", "--replay", "temperature")
    assert replayed["max_abs_dev"] <= 1e-4, replayed
    assert ignored["buckets"]["lag"]["0"]["k1"] > 1e-2 and ignored["mean_log_kept"] == 0.0, ignored


@pytest.mark.timeout(400)
def test_a_slow_trainer_paces_generation_instead_of_dropping_stale_samples(tmp_path: Path) -> None:
    """``--max-staleness 2`` with a deliberately slow trainer: the rollouts run ahead of it
    by two versions and no further (some wait for the trainer), every trained sample is at
    most two versions behind, and none is dropped. The mismatch report says where a step's
    deviation comes from: tokens one and two versions behind (lag buckets 1 and 2) deviate,
    tokens of the trainer's own version (lag 0) do not."""
    data_dir = tmp_path / "tt"
    summary = run_small(
        data_dir,
        tmp_path / "run.log",
        *("--train-steps", "4", "--max-staleness", "2", "--trainer-delay-s", "5"),
        *("--broker-storage", "memory", "--stages", "inline"),
    )
    assert summary["status"] == "completed" and summary["finalized"] == summary["rollouts"] == 16, summary
    steps = summary["train_steps"]
    assert [step["step"] for step in steps] == [1, 2, 3, 4]
    assert [step["weight_version"] for step in steps] == [0, 1, 2, 3]
    assert all(step["stale_dropped"] == 0 for step in steps), steps
    assert all(step["staleness_max"] is not None and step["staleness_max"] <= 2 for step in steps), steps
    assert max(step["staleness_max"] for step in steps) == 2, steps  # generation ran ahead
    assert summary["paced_waits"] > 0, summary  # and was held back
    buckets = [check_mismatch(step)["buckets"]["lag"] for step in steps]
    lagged = [(lag, bucket) for buckets_ in buckets for lag, bucket in buckets_.items() if lag != "0"]
    assert {lag for lag, _ in lagged} == {"1", "2"}, buckets
    assert all(bucket["tokens"] > 0 and bucket["max_abs_dev"] > 1e-2 for _, bucket in lagged), lagged
    assert all(lag["0"]["max_abs_dev"] <= 1e-4 for lag in buckets if "0" in lag), buckets
    assert summary["dataplane_samples_left"] == 0
    samples = export(data_dir)
    for sample in samples:
        check_sample(sample)  # every token's version stays on the sample
    assert max(max(sample["weight_versions"]) for sample in samples) >= 1  # refits reached generation


def librdkafka_view(bootstrap: str, groups: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """What librdkafka (confluent-kafka), not aiokafka, reads of a running pipeline: the
    finalized events, and each group's lag (end offset − committed, summed over the
    partitions it committed)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    committed: dict[str, list[TopicPartition]] = {}
    for group in groups:
        future = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group]
        committed[group] = list(future.result(timeout=30).topic_partitions)
    topics = {tp.topic for tps in committed.values() for tp in tps} | {FINALIZED_TOPIC}
    records, ends = read_to_end(bootstrap, topics)
    lag = {
        group: sum(ends[(tp.topic, tp.partition)] - max(tp.offset, 0) for tp in tps)
        for group, tps in committed.items()
    }
    return [json.loads(value) for topic, value in records if topic == FINALIZED_TOPIC], lag


def read_to_end(
    bootstrap: str, topics: set[str]
) -> tuple[list[tuple[str, bytes]], dict[tuple[str, int], int]]:
    """Every record of ``topics`` from the beginning, and each partition's end offset,
    with partitions assigned (no group join) and read until each reports its end."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "e2e-reader", "enable.partition.eof": True}
    )
    try:
        metadata = consumer.list_topics(timeout=30).topics
        partitions = [
            TopicPartition(t, p, OFFSET_BEGINNING) for t in sorted(topics) for p in metadata[t].partitions
        ]
        consumer.assign(partitions)
        records: list[tuple[str, bytes]] = []
        ends: dict[tuple[str, int], int] = {}
        deadline = time.monotonic() + 60
        while len(ends) < len(partitions):
            assert time.monotonic() < deadline, (
                f"partitions never reached their end: {len(ends)}/{len(partitions)}"
            )
            message = consumer.poll(1.0)
            if message is None:
                continue
            error = message.error()
            if error is not None and error.code() == KafkaError._PARTITION_EOF:
                ends[(message.topic(), message.partition())] = message.offset()
                continue
            assert error is None, error
            records.append((message.topic(), message.value()))
        return records, ends
    finally:
        consumer.close()


@contextlib.contextmanager
def kept_run(data_dir: Path, log: Path, *extra: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """A ``run --keep``: yields its summary and ``serving.json`` while it serves, then
    stops it with SIGINT (a completed run still exits 0) and checks that it removed
    ``serving.json``."""
    argv = ["run", "--json", "--keep", *SMALL, *extra, "--data-dir", str(data_dir)]
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=err
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"run exited {proc.wait()} before its summary:\n{log.read_text()[-4000:]}"
        serving_file = data_dir / "serving.json"
        deadline = time.monotonic() + 30
        while not serving_file.is_file():
            assert time.monotonic() < deadline, "a kept run did not write serving.json"
            time.sleep(0.2)
        yield json.loads(line), json.loads(serving_file.read_text())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not serving_file.exists()


def check_the_credentials_a_kept_run_hands_out(data_dir: Path, serving: dict[str, Any]) -> None:
    directory = data_dir / "credentials"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    secrets = {path.name: path.read_text().strip() for path in directory.iterdir()}
    assert set(secrets) == {"operator.token", "environment.token", "service.token", "api.key", "agent.key"}
    assert all(stat.S_IMODE((directory / name).stat().st_mode) == 0o600 for name in secrets)
    assert Path(serving["operator_token_file"]) == directory / "operator.token"
    assert not any(secret in json.dumps(serving) for secret in secrets.values())
    version = f"{serving['worker']}/admin/weight_version"
    refused = httpx.get(version, headers={"authorization": f"Bearer {secrets['environment.token']}"})
    assert refused.status_code == 403 and secrets["environment.token"] not in refused.text
    assert httpx.get(version).status_code == 401
    operator = {"authorization": f"Bearer {secrets['operator.token']}"}
    assert httpx.get(version, headers=operator).json() == {"version": 0, "paused": False}
    # Plain generation, uncaptured, is for holders of the client key, which no agent gets.
    client = {"authorization": f"Bearer {secrets['api.key']}"}
    model = httpx.get(f"{serving['worker']}/v1/models", headers=client).json()["data"][0]["id"]
    chat = f"{serving['worker']}/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(chat, json=body, timeout=60).status_code == 401
    assert httpx.post(chat, json=body, headers=client, timeout=60).status_code == 200


@pytest.mark.timeout(400)
def test_sigint_stops_every_child_and_exits_130(tmp_path: Path) -> None:
    data_dir = tmp_path / "tt"
    log = tmp_path / "run.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.cli",
                "run",
                "--json",
                "--data-dir",
                str(data_dir),
                "--rollouts",
                "64",
                "--group-size",
                "4",
                "--max-tokens",
                "32",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 240
        while b"driving 64 rollouts" not in log.read_bytes():
            assert proc.poll() is None, f"run exited early ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the run did not start driving in time"
            time.sleep(0.5)
        assert (data_dir / "dataplane.json").is_file()
        time.sleep(2)  # rollouts in flight
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(command_line(child) for child in children)
        assert "tansu" in names and "objectstore" in names, names
        assert "stage ledger" in names and "stage finalizer" in names, names
        assert len(children) >= 5  # broker, its store, the engine core, two stages (at least)

        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:  # the test failed before the run stopped: do not leak it
            leftovers = psutil.Process(proc.pid).children(recursive=True)
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                for process in [proc, *leftovers]:
                    with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                        process.kill()
                proc.wait()
    assert proc.returncode == 130, log.read_text()[-4000:]
    assert took < 60
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [(p.pid, p.name()) for p in alive]
    summary = json.loads(out)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"
    assert summary["finalized"] + summary["missing"] == 64
    assert not (data_dir / "dataplane.json").exists()  # the owner removed its address file


@pytest.mark.timeout(300)
def test_a_stage_process_that_dies_fails_the_run(tmp_path: Path) -> None:
    """A stage child that exits on its own stops the run as a failure, as a stage task
    that stops does with ``--stages inline``; the other stage and every part still stop."""
    data_dir = tmp_path / "tt"
    log = tmp_path / "run.log"
    argv = ["run", "--json", *SMALL, "--broker-storage", "memory", "--data-dir", str(data_dir)]
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=err
        )
    try:
        deadline = time.monotonic() + 240
        while b": starting the worker" not in log.read_bytes():  # the stages are ready
            assert proc.poll() is None, f"run exited early ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the run did not get its stages ready in time"
            time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
        (finalizer,) = [child for child in children if "stage finalizer" in command_line(child)]
        finalizer.kill()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, log.read_text()[-4000:]
    summary = json.loads(out)
    assert summary["status"] == "failed", summary
    assert f"stage finalizer stopped (process {finalizer.pid}, exit code -9)" in summary["error"], summary
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [(p.pid, command_line(p)) for p in alive]


def command_line(process: psutil.Process) -> str:
    """A child's command line, or nothing for one that exited since it was listed."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("agent", ["driver", "sdk"])
def test_trl_grpo_trainer_trains_on_the_samples(tmp_path: Path, agent: str) -> None:
    """``--trainer trl``: TRL's GRPOTrainer asks for each step's groups, trains on the verified
    samples, and its weights refit the worker: the second step's samples carry version 1,
    and TRL's model recomputes the captured logprobs at both steps. The groups are played
    by the built-in driver, or through the gateway by an agent that only knows the SDK."""
    data_dir = tmp_path / "tt"
    summary = run_small(
        data_dir,
        tmp_path / "run.log",
        *("--trainer", "trl", "--train-steps", "2", "--broker-storage", "memory", "--stages", "inline"),
        *("--agent", agent),
        *TRUNCATED_FLAGS,
    )
    assert summary["status"] == "completed" and summary["accepted"] == summary["rollouts"] == 8, summary
    first, second = summary["train_steps"]
    assert [first["weight_version"], second["weight_version"]] == [0, 1]
    assert first["samples"] + first["rejected_filled"] == second["samples"] + second["rejected_filled"] == 4
    assert first["ratio_max_abs_dev"] <= 1e-4 and second["ratio_max_abs_dev"] <= 1e-4, summary["train_steps"]
    # The truncation is replayed: at step 1 the kept mass shows. TRL's first Adam step can
    # collapse the tiny model so far that top-p keeps one token of probability 1.0 in float32
    # at step 2 (log S exactly 0), so there only its sign is certain; the spans below say
    # that the provenance itself was never lost.
    assert check_mismatch(first)["mean_log_kept"] < 0 and check_mismatch(second)["mean_log_kept"] <= 0
    assert isinstance(first["loss"], float) and isinstance(second["loss"], float)
    for step in (first, second):  # TRL's own importance ratio, each call's sampling replayed
        trl = step["trl"]
        assert trl["loss"] == step["loss"] and "clip_ratio/region_mean" in trl, trl
        assert abs(trl["sampling/importance_sampling_ratio/min"] - 1) <= 1e-4, trl
        assert abs(trl["sampling/importance_sampling_ratio/max"] - 1) <= 1e-4, trl
        assert step["unreplayable_masked_tokens"] == 0
    assert summary["dataplane_samples_left"] == 0
    before = load_file(data_dir / "tiny-model" / "model.safetensors")
    after = load_file(data_dir / "weights" / "step-1" / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before), "TRL's step changed nothing"
    samples = export(data_dir)
    assert all(span["sampling"] == TRUNCATED for sample in samples for span in sample["spans"]), samples
    versions = Counter(frozenset(sample["weight_versions"]) for sample in samples)
    assert versions == {frozenset({0}): 4, frozenset({1}): 4}


@pytest.mark.timeout(400)
def test_trl_paced_runs_ahead_by_max_staleness_and_corrects_the_stale_tokens(tmp_path: Path) -> None:
    """``--trainer trl --max-staleness 1``: generation runs ahead of TRL's steps by one
    version and no further (held back by the same gate as the built-in trainer), TRL trains
    each step's own groups in the planned order, nothing is dropped, every rollout is
    accounted for, and TRL's own importance ratio against the captured logprobs is off 1 on
    the stale tokens (the report's lag-1 bucket) and 1 on the fresh ones."""
    data_dir = tmp_path / "tt"
    summary = run_small(
        data_dir,
        tmp_path / "run.log",
        *("--trainer", "trl", "--train-steps", "3", "--max-staleness", "1"),
        *("--broker-storage", "memory", "--stages", "inline"),
    )
    assert summary["status"] == "completed" and summary["rollouts"] == 12, summary
    assert summary["finalized"] == 12 and summary["missing"] == 0, summary
    assert summary["accepted"] + sum(summary["rejected"].values()) == 12, summary
    steps = summary["train_steps"]
    assert [step["weight_version"] for step in steps] == [0, 1, 2]
    assert all(step["samples"] + step["rejected_filled"] == 4 for step in steps), steps
    assert all(step["stale_dropped"] == 0 and step["staleness_max"] <= 1 for step in steps), steps
    assert max(step["staleness_max"] for step in steps) == 1, steps  # generation ran ahead
    assert summary["paced_waits"] > 0, summary  # and was held back
    lags = [check_mismatch(step)["buckets"]["lag"] for step in steps]
    assert any(lag.get("1", {}).get("tokens", 0) > 0 for lag in lags), lags
    assert all(lag["0"]["max_abs_dev"] <= 1e-4 for lag in lags if "0" in lag), lags
    for step, lag in zip(steps, lags, strict=True):
        trl = step["trl"]
        assert "sampling/importance_sampling_ratio/max" in trl and "clip_ratio/region_mean" in trl, trl
        ratio_off = max(
            abs(trl["sampling/importance_sampling_ratio/max"] - 1),
            abs(trl["sampling/importance_sampling_ratio/min"] - 1),
        )
        if lag.get("1", {}).get("max_abs_dev", 0.0) > 1e-2:  # stale tokens: TRL corrects them
            assert ratio_off > 1e-3, (trl, lag)
        else:  # every token sampled by the weights TRL holds
            assert ratio_off <= 1e-4, (trl, lag)
    assert summary["dataplane_samples_left"] == 0
    samples = export(data_dir)
    for sample in samples:
        check_sample(sample)
    assert max(max(sample["weight_versions"]) for sample in samples) >= 1  # refits reached generation


@pytest.mark.timeout(400)
def test_a_model_s_generation_config_sampling_is_recorded_and_replayed(tmp_path: Path) -> None:
    """A model that ships sampling defaults (Qwen3's top-p 0.95, top-k 20) and a run that
    sends only its temperature: vLLM samples with those defaults, every span records them,
    and the built-in trainer replays them (on policy to 1e-4, not the 0.35 of ignoring them)."""
    data_dir = tmp_path / "tt"
    model = tmp_path / "model"
    done = tokentrail("make-tiny-model", str(model), timeout=120)
    assert done.returncode == 0, done.stderr
    config_path = model / "generation_config.json"
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # as Qwen3 ships them
    config = json.loads(config_path.read_text()) | qwen3
    config_path.write_text(json.dumps(config))
    summary = run_small(
        data_dir,
        tmp_path / "run.log",
        *("--model", str(model), "--train-steps", "1", "--broker-storage", "memory", "--stages", "inline"),
    )
    assert summary["status"] == "completed" and summary["accepted"] == 4, summary
    (step,) = summary["train_steps"]
    assert step["ratio_max_abs_dev"] <= 1e-4, step
    check_mismatch(step)
    for sample in export(data_dir):  # the driver's temperature 1.0 wins; the filters are the model's
        assert all(span["sampling"] == {"top_p": 0.95, "top_k": 20} for span in sample["spans"]), sample
