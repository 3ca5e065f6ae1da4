"""What a run tells its stage processes: the command line of ``tokentrail stage``, parsed
back by the real parser, carries every setting an in-process stage gets."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest

from pipeline import cli
from pipeline.kafka.config import KafkaConfig, config_from_args, kafka_arguments, kafka_environment
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.retention import FOREVER, TopicRetention
from pipeline.process.flags import from_flags
from pipeline.run.config import RunConfig
from pipeline.run.services import RUN_GROUPS, data_plane_settings, run_groups
from pipeline.stagehost.processes import CLI_MODULE, StageOptions, stage_command
from pipeline.stagehost.settings import StageHostSettings, StageName
from stages.ledger.closed import DEFAULT_BUDGET_BYTES as DEFAULT_CLOSED_BUDGET_BYTES
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import RecordingSink
from stages.specs import STAGES, StageSettings, staging_ttl
from topics.names import TopicNames

SECURE = KafkaConfig(
    bootstrap_servers="kafka-1:9093,kafka-2:9093",
    client_id="tt-run",
    names=TopicNames(prefix="exp7", partitions=8),
    security_protocol="SASL_SSL",
    sasl_mechanism="SCRAM-SHA-512",
    sasl_plain_username="trainer",
    sasl_plain_password="s3cret",
    ssl_cafile="/etc/ca.pem",
    retention=TopicRetention(admission=5 * 86_400_000, deadletter=FOREVER),
)


def parsed(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", CLI_MODULE]
    return cli.build_parser().parse_args(argv[3:])


def settings(argv: list[str]) -> StageHostSettings:
    """What the child process runs with: its command line, parsed as ``tokentrail stage`` does."""
    return from_flags(StageHostSettings, parsed(argv))


def test_the_stage_names_are_the_stages() -> None:
    assert set(get_args(StageName)) == set(STAGES)


def test_the_stage_command_carries_the_runs_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = LedgerConfig(seal_grace_s=2.5, max_open_s=120.0)
    plane = {"dataplane_mode": "attach", "dataplane_addresses": Path("/data/dataplane.json")}
    tuning = replace(RUN_GROUPS, fetch_wait_ms=40, idle_margin_ms=120)
    options = StageOptions(ledger=ledger, tuning=tuning, data_plane=plane)
    for name in ("ledger", "finalizer"):
        argv = stage_command(name, SECURE, options)
        assert "s3cret" not in " ".join(argv)  # the password travels in the environment
        args = parsed(argv)
        child = from_flags(StageHostSettings, args)
        assert child.name == name
        assert (child.seal_grace_s, child.max_open_s, child.staging_ttl_s) == (
            2.5,
            120.0,
            staging_ttl(ledger),
        )
        assert child.ledger == ledger and child.tuning == tuning  # what the in-process stage gets
        assert child.group is None  # the stage's own group, as in process
        monkeypatch.setenv(args.sasl_password_env, kafka_environment(SECURE)[args.sasl_password_env])
        assert config_from_args(args) == SECURE
    finalizer = settings(stage_command("finalizer", SECURE, options))
    assert (finalizer.dataplane_mode, str(finalizer.dataplane_addresses)) == (
        "attach",
        "/data/dataplane.json",
    )
    assert "--dataplane-addresses" not in stage_command("ledger", SECURE, options)
    assert "--retention" not in kafka_arguments(KafkaConfig("k:9092"))  # the defaults go unsaid


def test_the_memory_brokers_short_merge_margin_reaches_the_stage_processes() -> None:
    tuning = run_groups(
        EmbeddedBroker(storage="memory"), RunConfig().fetch_wait_ms
    )  # not started: only its storage counts
    options = StageOptions(ledger=LedgerConfig(), tuning=tuning)
    child = settings(stage_command("ledger", KafkaConfig(bootstrap_servers="h:1"), options))
    assert child.merge_margin_ms == tuning.idle_margin_ms < RUN_GROUPS.idle_margin_ms


def test_the_runs_fetch_wait_reaches_its_stage_processes() -> None:
    """``tokentrail run --fetch-wait-ms``: the lever against tansu's listing cliff (DESIGN §3)."""
    tuning = run_groups(None, 250)
    assert tuning == replace(RUN_GROUPS, fetch_wait_ms=250)
    options = StageOptions(ledger=LedgerConfig(), tuning=tuning)
    assert (
        settings(stage_command("ledger", KafkaConfig(bootstrap_servers="h:1"), options)).fetch_wait_ms == 250
    )
    with pytest.raises(ValueError, match="fetch_wait_ms: must be >= 1, got 0"):
        RunConfig(fetch_wait_ms=0)


def test_a_group_is_passed_when_given() -> None:
    options = StageOptions(ledger=LedgerConfig(), tuning=RUN_GROUPS, group="tokentrail-ledger-b1")
    assert settings(stage_command("ledger", KafkaConfig(bootstrap_servers="h:1"), options)).group == (
        "tokentrail-ledger-b1"
    )


def test_the_stage_processes_reach_the_runs_data_plane() -> None:
    """Beside the run's own data plane the finalizer keeps no sample copies (they would die
    with the run); beside a Ray data plane it spools them under the run's data directory."""
    options = StageOptions(
        ledger=LedgerConfig(),
        tuning=RUN_GROUPS,
        data_plane=data_plane_settings(RunConfig(), RunConfig().data_dir / "dataplane.json"),
    )
    embedded = settings(stage_command("finalizer", KafkaConfig("h:1"), options))
    assert (embedded.dataplane_mode, embedded.dataplane_addresses, embedded.retain_samples_bytes) == (
        "attach",
        Path(".tokentrail/dataplane.json"),
        0,
    )
    ray = RunConfig(dataplane_mode="ray", ray_address="auto")
    options = replace(options, data_plane=data_plane_settings(ray, ray.data_dir))
    child = settings(stage_command("finalizer", KafkaConfig("h:1"), options))
    assert (child.dataplane_mode, child.ray_address, child.spool_dir) == (
        "ray",
        "auto",
        Path(".tokentrail/retained-samples"),
    )
    assert child.retain_samples_bytes > 0
    options = replace(options, data_plane=data_plane_settings(RunConfig(dataplane_mode="ray"), ray.data_dir))
    assert settings(stage_command("finalizer", KafkaConfig("h:1"), options)).ray_address is None


def test_the_finalizers_sample_copies_are_configured_by_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Owners, budget and spool directory reach the parser; a negative budget is a usage
    error naming the flag."""
    base = ["stage", "finalizer", "--bootstrap", "b:9092"]
    args = cli.build_parser().parse_args(
        [*base, "--sample-owner", "tokentrail-archive", "--sample-owner", "g2", "--retain-dir", "/x/spool"]
    )
    child = from_flags(StageHostSettings, args)
    assert child.owners == ["tokentrail-archive", "g2"] and child.spool_dir == Path("/x/spool")
    assert child.retain_samples_bytes == 256 * 2**20
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*base, "--retain-samples-bytes", "-1"])
    assert exited.value.code == 2 and "--retain-samples-bytes" in capsys.readouterr().err


def test_the_ledgers_closed_rollouts_budget_is_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--closed-budget-mib`` defaults to the ledger's own budget; a negative one is a
    usage error naming the flag."""
    base = ["stage", "ledger", "--bootstrap", "b:9092"]
    default = from_flags(StageHostSettings, cli.build_parser().parse_args(base))
    assert default.stage_settings.closed_budget_bytes == DEFAULT_CLOSED_BUDGET_BYTES
    given = from_flags(
        StageHostSettings, cli.build_parser().parse_args([*base, "--closed-budget-mib", "0.25"])
    )
    assert given.stage_settings.closed_budget_bytes == 2**18
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*base, "--closed-budget-mib", "-1"])
    assert exited.value.code == 2 and "--closed-budget-mib" in capsys.readouterr().err


def test_the_closed_rollouts_budget_reaches_the_ledger() -> None:
    settings = StageSettings(closed_budget_bytes=4096)
    stage = STAGES["ledger"].build(RecordingSink(), settings=settings)
    assert isinstance(stage, LedgerStage) and stage.closed.budget_bytes == 4096


def test_the_runs_stage_bounds_reach_its_stages_in_process_and_as_children() -> None:
    run = RunConfig(remember=1234, closed_budget_mib=0.5)
    options = StageOptions(ledger=LedgerConfig(), tuning=RUN_GROUPS, bounds=run.bounds)
    for name in ("ledger", "finalizer"):
        child = settings(stage_command(name, SECURE, options))
        assert (child.remember, child.closed_budget_mib) == (1234, 0.5)
        assert child.stage_settings.closed_budget_bytes == 2**19
    built = options.in_process
    assert (built.remember, built.closed_budget_bytes) == (1234, 2**19)
    assert built.janitor.ttl_s == staging_ttl(options.ledger)


def test_the_runs_sample_copy_budget_reaches_a_finalizer_on_ray_and_is_refused_on_the_embedded_plane() -> (
    None
):
    run = RunConfig(dataplane_mode="ray", ray_address="auto", retain_samples_bytes=4096)
    plane = data_plane_settings(run, Path("unused.json"))
    options = StageOptions(ledger=LedgerConfig(), tuning=RUN_GROUPS, data_plane=plane, bounds=run.bounds)
    assert settings(stage_command("finalizer", SECURE, options)).retain_samples_bytes == 4096
    embedded = RunConfig()  # its plane ends with the run: the finalizer keeps no copies
    plane = data_plane_settings(embedded, Path("dataplane.json"))
    options = StageOptions(ledger=LedgerConfig(), tuning=RUN_GROUPS, data_plane=plane, bounds=embedded.bounds)
    assert settings(stage_command("finalizer", SECURE, options)).retain_samples_bytes == 0
    with pytest.raises(ValueError, match="retain_samples_bytes: the embedded data plane"):
        RunConfig(retain_samples_bytes=4096)
