"""Retention of the topics (DESIGN §7.6) without a broker: the rules, the refusal of a
retention shorter than the pipeline needs, and what is done about records the log
deleted before a group read them (the lag command's lost ranges, the consumer loop's)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Callable

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError

from pipeline import cli
from pipeline.commands import lag as lag_command
from pipeline.kafka import lag_report
from pipeline.kafka.config import KafkaConfig, config_from_args
from pipeline.kafka.consumer import ConsumerLoop
from pipeline.kafka.lag import LostRange, PartitionLag, lost_range
from pipeline.kafka.retention import (
    DEFAULT_RETENTION,
    FOREVER,
    ROLES,
    TopicRetention,
    differences,
    format_ms,
    minimum_ms,
    parse_duration,
    retention_setting,
)
from pipeline.run.config import Attach, RunConfig
from pipeline.stagehost.metrics import StageMetrics
from topics.names import TopicNames

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("90", 90_000), ("90s", 90_000), ("90m", 5_400_000), ("1.5h", 5_400_000),
     ("3d", 3 * DAY_MS), ("2w", 14 * DAY_MS), ("forever", FOREVER), ("Forever", FOREVER)],
)  # fmt: skip
def test_durations_read_with_their_unit(text: str, ms: int) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize("text", ["", "3 days", "-1h", "0", "0.0001ms", "h", "1y"])
def test_a_duration_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|longer than 0"):
        parse_duration(text)


def test_durations_are_written_in_the_largest_whole_unit() -> None:
    assert [format_ms(v) for v in (FOREVER, 500, 90_000, 5_400_000, 3 * DAY_MS, 14 * DAY_MS, 4_600_000)] == [
        "forever", "500ms", "90s", "90m", "3d", "2w", "4600s",
    ]  # fmt: skip


def test_every_topic_is_created_to_be_deleted_by_time_only() -> None:
    names = TopicNames(prefix="exp", partitions=8)
    configs = DEFAULT_RETENTION.topic_configs(names)
    assert set(configs) == set(names.all())
    for topic, settings in configs.items():
        assert settings["cleanup.policy"] == "delete"
        assert settings["retention.bytes"] == "-1"  # no size bound, whatever the cluster's default
        assert int(settings["retention.ms"]) >= 3 * DAY_MS, topic
    assert configs["exp.finalized"]["retention.ms"] == str(7 * DAY_MS)
    assert configs["exp.deadletter"]["retention.ms"] == str(30 * DAY_MS)


def test_the_defaults_outlive_what_the_pipeline_needs_with_room_for_a_weekend() -> None:
    for max_open_s in (600.0, 3600.0):  # tokentrail run's, tokentrail stage's
        assert DEFAULT_RETENTION.shortfalls(max_open_s) == []
    assert min(getattr(DEFAULT_RETENTION, role) for role in ROLES) >= 3 * DAY_MS


def test_the_least_retention_is_max_open_plus_an_hour() -> None:
    assert minimum_ms(3600.0) == 2 * HOUR_MS
    assert minimum_ms(600.0) == 4_200_000
    at_the_limit = TopicRetention(**dict.fromkeys(ROLES, 2 * HOUR_MS))
    assert at_the_limit.shortfalls(3600.0) == []
    assert len(at_the_limit.shortfalls(3601.0)) == len(ROLES)
    assert TopicRetention(**dict.fromkeys(ROLES, FOREVER)).shortfalls(10**9) == []


def test_a_short_retention_is_refused_naming_the_flag_and_the_figure() -> None:
    short = DEFAULT_RETENTION.with_values([("staged", 90 * 60_000)])
    (problem,) = short.shortfalls(3600.0)
    assert problem.startswith("--retention staged=90m is shorter than the 2h the pipeline needs")
    assert "1h (the ledger's --max-open)" in problem
    with pytest.raises(ValueError, match="staged=90m"):
        short.check(3600.0)


def test_a_retention_flag_names_a_role_and_a_duration() -> None:
    assert retention_setting("admission=5d") == ("admission", 5 * DAY_MS)
    assert retention_setting(" deadletter=forever") == ("deadletter", FOREVER)
    for bad, named in (
        ("ledger=5d", "ROLE one of admission"),
        ("admission", "ROLE=DURATION"),
        ("staged=x", "staged"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            retention_setting(bad)


def test_the_last_retention_given_for_a_role_wins_and_the_others_keep_their_default() -> None:
    args = cli.build_parser().parse_args(
        [
            "stage",
            "ledger",
            "--bootstrap",
            "b:9092",
            "--retention",
            "admission=1d",
            "--retention",
            "admission=4d",
        ]
    )
    retention = config_from_args(args).retention
    assert retention.admission == 4 * DAY_MS
    assert retention.staged == DEFAULT_RETENTION.staged


def test_differences_name_each_setting_found_otherwise() -> None:
    asked = {"cleanup.policy": "delete", "retention.ms": str(3 * DAY_MS), "retention.bytes": "-1"}
    assert differences(asked, {**asked}) == []
    assert differences(
        asked, {"cleanup.policy": "delete", "retention.ms": str(DAY_MS), "retention.bytes": "-1"}
    ) == ["retention.ms: found 1d, asked 3d"]
    assert differences(asked, {}) == [
        "cleanup.policy: found unset, asked delete",
        "retention.ms: found unset, asked 3d",
        "retention.bytes: found unset, asked -1",
    ]


def test_the_broker_refuses_to_create_topics_kept_shorter_than_the_ledger_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before any broker starts: a usage error (2) naming the flag and the figure."""
    argv = ["broker", "--create-topics", "--retention", "admission=1h", "--max-open", "7200"]
    args = cli.build_parser().parse_args(argv)
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert "--retention admission=1h is shorter than the 3h the pipeline needs" in err
    assert "2h (the ledger's --max-open)" in err
    args = cli.build_parser().parse_args(["broker", "--retention", "admission=5d"])
    assert args.run(args) == 2
    assert "--create-topics" in capsys.readouterr().err


def test_a_stage_refuses_a_retention_shorter_than_its_max_open(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("pipeline.commands.stage.collect_per_batch", lambda: None)  # this process's collector
    args = cli.build_parser().parse_args(
        ["stage", "ledger", "--bootstrap", "127.0.0.1:1", "--max-open", "7200", "--retention", "committed=2h"]
    )
    assert args.run(args) == 2  # before any broker is asked
    assert "--retention committed=2h is shorter than the 3h" in capsys.readouterr().err


def test_run_and_drive_refuse_a_retention_their_ledger_outlives() -> None:
    kept_90m = DEFAULT_RETENTION.with_values([("finalized", 90 * 60_000)])
    with pytest.raises(ValueError, match="finalized=1h is shorter than the 70m"):
        RunConfig(
            kafka=KafkaConfig(retention=kept_90m.with_values([("finalized", HOUR_MS)]))
        )  # --max-open 600
    RunConfig(kafka=KafkaConfig(retention=kept_90m))
    with pytest.raises(
        ValueError, match="finalized=90m is shorter than the 2h"
    ):  # a cluster's ledger: 3600 s
        RunConfig(kafka=KafkaConfig("k:9092", retention=kept_90m), attach=Attach(worker_url="http://w"))


# -- records the log deleted before a group read them ----------------------------------------


def test_a_commit_below_the_log_start_is_a_lost_range_not_lag() -> None:
    row = PartitionLag("tokentrail-ledger", "tt.admission", 2, committed=100, log_start=150, highwater=400)
    assert row.lag == 250
    assert row.lost == LostRange("tokentrail-ledger", "tt.admission", 2, 100, 150)
    assert row.lost.records == 50
    assert str(row.lost) == (
        "group tokentrail-ledger lost tt.admission[2] offsets 100 to 149 (50 records): "
        "the log deleted them before the group read them"
    )
    assert row.as_dict()["lost_records"] == 50
    assert lost_range("g", "t", 0, None, 150) is None  # never committed: starts at the log start
    assert lost_range("g", "t", 0, 150, 150) is None
    assert lost_range("g", "t", 0, 149, 150) == LostRange("g", "t", 0, 149, 150)


def test_lag_names_each_lost_range_and_exits_4(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        PartitionLag("tokentrail-trainer", "tt.finalized", 0, committed=10, log_start=40, highwater=50),
        PartitionLag("tokentrail-trainer", "tt.finalized", 1, committed=45, log_start=40, highwater=50),
    ]

    async def read(
        config: KafkaConfig, groups: list[str] | None, topics: list[str] | None
    ) -> list[PartitionLag]:
        return rows

    monkeypatch.setattr(lag_command, "read_lag", read)
    for extra in ([], ["--json"]):
        args = cli.build_parser().parse_args(["lag", "--bootstrap", "k:9092", *extra])
        assert args.run(args) == lag_command.EXIT_RECORDS_LOST
        out, err = capsys.readouterr()
        if extra:
            assert json.loads(out)["lost"][0]["records"] == 30
        assert err.strip() == (
            "tokentrail lag: LOST: group tokentrail-trainer lost tt.finalized[0] offsets 10 to 39 "
            "(30 records): the log deleted them before the group read them"
        )
    report = lag_report.report("k:9092", rows)
    assert report["lost"] == [
        {
            "group": "tokentrail-trainer",
            "topic": "tt.finalized",
            "partition": 0,
            "first": 10,
            "end": 40,
            "records": 30,
        }
    ]
    assert report["total_lag"] == 10 + 5
    rows[0] = PartitionLag("tokentrail-trainer", "tt.finalized", 0, committed=40, log_start=40, highwater=50)
    args = cli.build_parser().parse_args(["lag", "--bootstrap", "k:9092"])
    assert args.run(args) == 0


class FakeConsumer:
    """What ``ConsumerLoop._reposition`` asks of aiokafka's consumer."""

    def __init__(self, starts: dict[TopicPartition, int]) -> None:
        self.starts = starts
        self.sought: dict[TopicPartition, int] = {}

    def assignment(self) -> set[TopicPartition]:
        return set(self.starts)

    async def beginning_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.starts[tp] for tp in partitions}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.sought[tp] = offset


def test_the_consumer_loop_never_skips_deleted_records_silently(
    unconnected_loop: Callable[..., ConsumerLoop], caplog: pytest.LogCaptureFixture
) -> None:
    """A position below the log start is logged as an error naming group, partition and
    offsets, counted, and the loop goes on from the log start (commits pass the gap)."""
    loop = unconnected_loop()
    tp = TopicPartition("t", 0)
    consumer = FakeConsumer({tp: 150})
    with caplog.at_level(logging.ERROR, "pipeline.kafka.consumer"):
        asyncio.run(loop._reposition(consumer, OffsetOutOfRangeError({tp: 100})))  # type: ignore[arg-type]
    assert consumer.sought == {tp: 150}
    assert loop.stats.lost == {("t", 0): 50}
    assert loop._positions[tp] == 150
    (record,) = caplog.records
    assert record.levelname == "ERROR"
    assert "group g lost t[0] offsets 100 to 149 (50 records)" in record.getMessage()

    metrics = StageMetrics("ledger", process=False)
    metrics.watch_loop("g", loop.stats)
    labels = {"stage": "ledger", "group": "g", "topic": "t", "partition": "0"}
    assert metrics.registry.get_sample_value("tokentrail_consumer_lost_records_total", labels) == 50


def test_a_partition_without_a_position_or_past_its_end_starts_at_the_log_start_losing_nothing(
    unconnected_loop: Callable[..., ConsumerLoop], caplog: pytest.LogCaptureFixture
) -> None:
    loop = unconnected_loop()
    fresh, truncated, gone = TopicPartition("t", 0), TopicPartition("t", 1), TopicPartition("t", 9)
    consumer = FakeConsumer({fresh: 7, truncated: 0})

    async def go() -> None:
        await loop._reposition(consumer, NoOffsetForPartitionError(fresh))  # type: ignore[arg-type]
        await loop._reposition(consumer, OffsetOutOfRangeError({truncated: 500, gone: 3}))  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, "pipeline.kafka.consumer"):
        asyncio.run(go())
    assert consumer.sought == {fresh: 7, truncated: 0}  # a partition no longer assigned is left alone
    assert loop.stats.lost == {}
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "offset 500 of t[1] is past its end" in caplog.records[0].getMessage()
