"""The inspector's data source over a real run's data directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from inspectkit import RunDir

from pipeline.inspect.log import LogUnavailable, read_live_log
from pipeline.inspect.source import NotADataDir, RunSource, check_data_dir
from pipeline.inspect.table import MAX_PER_PAGE, TableQuery
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import BUCKET_DIR, CLUSTER_ID_FILE, EmbeddedBroker, free_port
from pipeline.run.config import TINY_MODEL_DIR_NAME
from topics.failures import MEANINGS

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]


@pytest.fixture(scope="module")
def source(run_dir: RunDir, tmp_path_factory: pytest.TempPathFactory) -> RunSource:
    return RunSource.open(run_dir.path, tmp_path_factory.mktemp("scratch"))


def test_every_rollout_of_the_log_is_in_the_table(source: RunSource, run_dir: RunDir) -> None:
    assert source.log_problem is None
    assert len(source.table) == 4 + len(run_dir.extra)
    rows = {s: source.table.get(r) for s, r in run_dir.extra.items()}
    assert {s: row.status if row else None for s, row in rows.items()} == {
        "chains": "accepted",
        "ambiguous": "rejected",
        "corrupt": "rejected",
    }


def test_a_chains_rollout_shows_two_samples(source: RunSource, run_dir: RunDir) -> None:
    detail = source.rollout(run_dir.extra["chains"])
    assert detail is not None
    assert [c.sample_key is not None for c in detail.chains] == [True, True]
    assert all(source.tokens(str(c.sample_key)) is not None for c in detail.chains)


def test_a_rejection_names_its_code_meaning_and_culprit(source: RunSource, run_dir: RunDir) -> None:
    corrupt = source.rollout(run_dir.extra["corrupt"])
    assert corrupt is not None and corrupt.rejection is not None
    assert (corrupt.rejection.code, corrupt.rejection.family) == ("digest_mismatch", "FinalizerFailure")
    assert corrupt.rejection.meaning == MEANINGS["digest_mismatch"]
    culprit = run_dir.call_ids[run_dir.extra["corrupt"]]["b"]
    assert [n.call.call_id for n in corrupt.nodes if n.caused_rejection] == [culprit]
    ambiguous = source.rollout(run_dir.extra["ambiguous"])
    assert ambiguous is not None and ambiguous.rejection is not None
    assert ambiguous.rejection.code == "ambiguous_terminal"


def test_a_path_that_is_not_a_data_dir_is_named(tmp_path: Path) -> None:
    with pytest.raises(NotADataDir, match=str(tmp_path)):
        check_data_dir(tmp_path)
    with pytest.raises(NotADataDir, match="no such directory"):
        check_data_dir(tmp_path / "absent")


def test_without_a_log_the_archive_is_still_shown(run_dir: RunDir, tmp_path: Path) -> None:
    """A data directory whose log is gone: every archived rollout listed, the reason kept."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(run_dir.path / "samples.jsonl", bare / "samples.jsonl")
    source = RunSource.open(bare, tmp_path / "scratch")
    assert source.log_problem is not None and str(bare) in source.log_problem
    assert source.table.statuses() == {"accepted": len({r["rollout_id"] for r in source.samples.values()})}
    assert source.rollout(run_dir.extra["chains"]) is None
    assert all(source.tokens(key) is not None for key in source.samples)


def test_a_running_deployment_is_read_from_its_brokers(
    source: RunSource, run_dir: RunDir, tmp_path: Path
) -> None:
    """``--bootstrap``: the same log served by a live broker gives the same rollouts; with
    the brokers down, the archive is still shown and the reason names them."""
    live = tmp_path / "live"
    shutil.copytree(run_dir.path / BUCKET_DIR, live / BUCKET_DIR)
    shutil.copy2(run_dir.path / CLUSTER_ID_FILE, live / CLUSTER_ID_FILE)
    archive = tmp_path / "archive"
    archive.mkdir()
    shutil.copy2(run_dir.path / "samples.jsonl", archive / "samples.jsonl")
    model = run_dir.path / TINY_MODEL_DIR_NAME
    with EmbeddedBroker(storage="durable", data_dir=live) as broker:
        served = RunSource.open(archive, tmp_path / "scratch", model, broker.kafka_config())
    assert served.log_problem is None
    assert outcomes(served) == outcomes(source)

    down = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}")
    log = read_live_log(down, tmp_path / "down", timeout_s=5)
    assert isinstance(log, LogUnavailable) and down.bootstrap in log.reason


def outcomes(source: RunSource) -> list[tuple[str, str, str | None]]:
    everything = source.table.page(TableQuery(per_page=MAX_PER_PAGE))
    return sorted((r.rollout_id, r.status, r.failure_code) for r in everything.rows)
