"""Every verb whose settings are a model: the command line ``to_argv`` writes parses back,
through the real parser, into the same settings; a bad value is a usage error (exit 2)
naming its flag, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from pipeline import cli
from pipeline.commands.make_tiny_model import TinyModelSettings
from pipeline.dataplane.settings import DataPlaneSettings
from pipeline.gateway.quotas import Quotas
from pipeline.gateway.settings import GatewaySettings
from pipeline.inspect.settings import InspectSettings
from pipeline.kafka.embedded.settings import BrokerSettings
from pipeline.kafka.lag_settings import LagSettings
from pipeline.process.flags import from_flags, to_argv
from pipeline.replay.settings import ReplaySettings, ShowSettings
from pipeline.run.config import Attach
from pipeline.samples.settings import ExportSettings
from pipeline.stagehost.sample_archive import ArchiveSettings
from pipeline.trainer.audit_settings import AuditSettings
from pipeline.worker.settings import WorkerSettings

KAFKA = ["--bootstrap", "127.0.0.1:1"]

ROUND_TRIPS: list[tuple[list[str], BaseModel]] = [
    (
        ["worker", *KAFKA],
        WorkerSettings(
            model_dir=Path("/models/m"),
            host="0.0.0.0",
            port=0,
            ack="enqueued",
            worker_id="w7",
            weight_version=3,
            span_policy="reject",
            logprob_path="vllm",
            prefix_wait_s=0.25,
            max_body_bytes=4096,
            retain_bytes=0,
            remember=12,
            template_family="chatml",
            tokenizer_mode="mistral",
            tool_call_parser="none",
            reasoning_parser="qwen3",
            dtype="bfloat16",
            max_model_len=512,
            kv_cache_bytes=2**20,
            seed=7,
            dataplane_addresses=Path("/run/dataplane.json"),
        ),
    ),
    (
        ["gateway", *KAFKA],
        GatewaySettings(
            workers="http://a:8000,http://b:8000",
            port=0,
            session_ttl_s=5.5,
            remember_sealed=300,
            sample_policy="chains",
            replica="gateway-1",
            max_open_s=120.0,
            checkpoint_every_s=2.0,
            max_body_bytes=1024,
            max_in_flight=2,
            max_calls=9,
            max_tokens=1000,
            max_request_bytes=10_000,
            worker_slots=4,
            max_staleness=1,
            rollouts_per_step=8,
        ),
    ),
    (
        ["replay", *KAFKA],
        ReplaySettings(
            out=Path("ledger.sqlite"),
            start_offsets=["tt.admission:0=12", "tt.staged:3=0"],
            seal_grace_s=2.5,
            processes=2,
            check=True,
        ),
    ),
    (
        ["replay", *KAFKA],
        ReplaySettings(
            out=Path("l.sqlite"), checkpoints=Path("ckpt"), checkpoint_margin_s=0.0, every_s=300.0
        ),
    ),
    (
        ["broker"],
        BrokerSettings(
            host="0.0.0.0",
            port=9092,
            storage="durable",
            data_dir="store",
            create_topics=True,
            retention_check_s=30,
        ),
    ),
    (["lag", *KAFKA], LagSettings(group=["ledger", "finalizer"], topic=["tt.admission"])),
    (
        ["samples", "export"],
        ExportSettings(
            data_dir=Path("runs/a"), format="parquet", out=Path("s.parquet"), run_id="r1", as_json=True
        ),
    ),
    (
        ["mismatch"],
        AuditSettings(
            samples=Path("s.jsonl"),
            model_dir=Path("m"),
            dtype="bfloat16",
            replay="none",
            policy_version=2,
            worst=0,
            batch_size=3,
        ),
    ),
    (["dataplane"], DataPlaneSettings(data_dir=Path("runs/x"), host="127.0.0.2")),
    (["ledger", "show"], ShowSettings(rollout_id="r-42", db=Path("l.sqlite"))),
    (["inspect"], InspectSettings(data_dir=Path("runs/x"), host="0.0.0.0", port=0, model_dir=Path("m"))),
    (
        ["make-tiny-model"],
        TinyModelSettings(dir=Path("tiny"), seed=3, vocab_size=300, template="llama3", moe=True),
    ),
    (["drive", *KAFKA], Attach(gateway_url="http://g", model="tiny", dataplane_addresses=Path("dp.json"))),
    (
        ["samples", "archive", *KAFKA],
        ArchiveSettings(
            out_dir=Path("archive"),
            format="parquet",
            rotate_records=5,
            rotate_s=0.5,
            label="exp",
            group="g",
            dataplane_addresses=Path("dp.json"),
        ),
    ),
]


@pytest.mark.parametrize(
    ("verb", "settings"), ROUND_TRIPS, ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_the_command_line_parses_back_into_the_same_settings(verb: list[str], settings: BaseModel) -> None:
    argv = to_argv(settings)
    assert argv, "every setting above is off its default, so each one is said"
    args = cli.build_parser().parse_args([*verb, *argv])
    assert from_flags(type(settings), args) == settings


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["worker", *KAFKA, "--model", "m", "--port", "-1"], "--port"),
        (["worker", *KAFKA, "--model", "m", "--max-body-bytes", "0"], "--max-body-bytes"),
        (["worker", *KAFKA, "--model", "m", "--ack", "never"], "--ack"),
        (["worker", *KAFKA, "--model", "m", "--chat-template", "/no/such/template"], "--chat-template"),
        (["worker", *KAFKA], "--model"),
        (["gateway", *KAFKA, "--workers", "http://w", "--max-in-flight", "0"], "--max-in-flight"),
        (["gateway", *KAFKA, "--workers", "http://w", "--session-ttl", "0"], "--session-ttl"),
        (["replay", *KAFKA, "--out", "o", "--from", "tt.admission=3"], "--from"),
        (["replay", *KAFKA, "--out", "o", "--processes", "0"], "--processes"),
        (["broker", "--port", "70000"], "--port"),
        (["samples", "archive", *KAFKA, "--out", "d", "--rotate-records", "0"], "--rotate-records"),
        (["samples", "archive", *KAFKA, "--out", "d", "--rotate-seconds", "0"], "--rotate-seconds"),
        (["mismatch", "s.jsonl", "--model", "m", "--batch-size", "0"], "--batch-size"),
        (["mismatch", "s.jsonl", "--model", "m", "--dtype", "float16"], "--dtype"),
        (["make-tiny-model", "tiny", "--template", "nope"], "--template"),
        (["inspect", "runs/x", "--port", "-1"], "--port"),
    ],
)
def test_a_bad_value_is_refused_as_it_is_parsed(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["gateway", *KAFKA, "--workers", "http://w", "--max-staleness", "1"],
            "pacing needs both --max-staleness and --rollouts-per-step",
        ),
        (["gateway", *KAFKA, "--workers", " , "], "--workers: name at least one worker URL"),
        (["replay", *KAFKA, "--out", "o", "--every", "5"], "--every: keeps a checkpoint current"),
        (
            ["replay", *KAFKA, "--out", "o", "--checkpoints", "c", "--from", "t:0=1"],
            "--from: a rebuild from checkpoints starts where the newest one ends",
        ),
        (["broker", "--storage", "durable"], "--data-dir: durable storage needs a data directory"),
        (["broker", "--retention", "admission=5d"], "--retention: sets the topics --create-topics creates"),
        (["samples", "export", "--format", "parquet"], "--out: required with parquet output"),
        (["samples", "export", "--json"], "--out: required with --json"),
        (["drive", *KAFKA], "--worker: give it or --gateway, one of them"),
        (["drive", *KAFKA, "--gateway", "http://g"], "--model-name: driving through a gateway"),
    ],
)
def test_settings_that_do_not_go_together_are_a_usage_error_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokentrail {argv[0]}") and message in err


def test_a_worker_reads_its_chat_template_once_and_cannot_say_it_as_a_flag(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    args = cli.build_parser().parse_args(["worker", *KAFKA, "--model", "m", "--chat-template", str(template)])
    settings = from_flags(WorkerSettings, args)
    assert settings.chat_template == "{{ messages }}"
    with pytest.raises(ValueError, match=r"^--chat-template:"):
        to_argv(settings)


def test_the_gateway_settings_give_its_config() -> None:
    from pipeline.auth.credentials import Credentials
    from pipeline.kafka.config import KafkaConfig

    settings = GatewaySettings(
        workers=" http://a:1 ,http://b:2,", max_calls=3, max_staleness=0, rollouts_per_step=4
    )
    config = settings.gateway_config(KafkaConfig(), Credentials())
    assert config.workers == ("http://a:1", "http://b:2")
    assert config.quotas == Quotas(max_calls=3)
    assert config.pacing is not None and (config.pacing.max_staleness, config.pacing.rollouts_per_step) == (
        0,
        4,
    )
    assert GatewaySettings(workers="http://a:1").gateway_config(KafkaConfig(), Credentials()).pacing is None


def test_the_worker_settings_give_its_bounds(model_dir: Path) -> None:
    from pipeline.auth.credentials import Credentials

    config = WorkerSettings(model_dir=model_dir, retain_bytes=5, remember=12).worker_config(Credentials())
    assert (config.retain_bytes, config.remember) == (5, 12)
