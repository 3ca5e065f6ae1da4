"""What an operator reads: the lag table in a pipe, the ledger in tree order."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import cli
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerLoop
from pipeline.kafka.lag import PartitionLag
from pipeline.kafka.lag_report import print_table, table
from pipeline.process.jsonlog import configure_logging, vllm_logging
from pipeline.replay.store import tree_order
from topics.records import CallRecord, FailedCall

HASH = "ab" * 32


def test_the_lag_table_never_cuts_names_in_a_pipe(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal, or a pipe
    group = "tokentrail-finalizer-with-a-long-deployment-suffix"
    topic = "cluster-a.tokentrail.committed"
    rows = [PartitionLag(group, topic, p, 5, 0, 7) for p in range(2)]
    print_table(table(rows))
    out = capsys.readouterr().out
    assert out.count(group) == 2 and out.count(topic) == 2
    assert "…" not in out


def call(call_id: str, parent: str | None, admitted_at: float) -> CallRecord:
    prev = 0 if parent is None else 5
    return CallRecord(
        rollout_id="r",
        call_id=call_id,
        parent_call_id=parent,
        mode="text" if parent is None else "token_in",
        prev_len=prev,
        delta_len=5,
        cum_len=prev + 5,
        weight_version=0,
        staging_key=f"r/{call_id}",
        chain_hash=HASH,
        cumulative_hash=HASH,
        digest=HASH,
        extras_digest=HASH,
        disposition="staged",
        admitted_at=admitted_at,
        staged_at=admitted_at + 1,
    )


def test_the_ledger_lists_calls_in_tree_order_not_by_id() -> None:
    calls = [
        call("c12", "c2", 12.0),
        call("c2", None, 2.0),
        call("c3", "c2", 3.0),
        FailedCall(rollout_id="r", call_id="c10", parent_call_id="c3", reason="not_served"),
        call("c4", "c3", 4.0),
        call("c9", None, 9.0),
    ]
    ordered = [(c.call_id, depth) for c, depth in tree_order(calls)]
    assert ordered == [("c2", 0), ("c3", 1), ("c4", 2), ("c10", 2), ("c12", 1), ("c9", 0)]


def _parsers(
    parser: argparse.ArgumentParser, path: str = "tokentrail"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_flag_of_every_verb_says_what_it_does() -> None:
    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in _parsers(cli.build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and not action.help
    ]
    assert missing == []


@pytest.mark.parametrize(("log_format", "json_lines"), [("auto", True), ("json", True), ("text", False)])
def test_every_process_logs_json_unless_on_a_terminal_or_told(
    log_format: Any, json_lines: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging(log_format)  # stderr is captured here: not a terminal
    logging.getLogger("pipeline.worker").warning("hello %s", "there")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    if json_lines:
        assert json.loads(line) | {"ts": 0} == {
            "ts": 0,
            "level": "warning",
            "logger": "pipeline.worker",
            "msg": "hello there",
        }
    else:
        assert line.endswith("WARNING pipeline.worker: hello there")


def test_vllm_logs_through_the_same_formatter_in_every_engine_process(monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    vllm_logging("json")
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "1"
    logging.config.dictConfig(config)  # what vLLM does in each process
    handler = logging.getLogger("vllm").handlers[0]
    record = logging.LogRecord("vllm.engine", logging.WARNING, __file__, 1, "slow step", None, None)
    assert json.loads(handler.format(record))["logger"] == "vllm.engine"
    logging.getLogger("vllm").handlers.clear()


def test_a_first_join_is_not_counted_as_a_rebalance(unconnected_loop: Callable[..., ConsumerLoop]) -> None:
    from aiokafka import TopicPartition

    loop = unconnected_loop()

    async def go() -> tuple[int, int]:
        await loop._on_revoked(set())  # what a member's first join reports
        first = loop.stats.rebalances
        await loop._on_revoked({TopicPartition("t", 0)})
        return first, loop.stats.rebalances

    assert asyncio.run(go()) == (0, 1)


@pytest.mark.parametrize(
    ("attach", "kafka", "error"),
    [
        ({}, "k:9092", "worker"),
        ({"worker_url": "http://w", "gateway_url": "http://g", "model": "m"}, "k:9092", "worker"),
        ({"gateway_url": "http://g"}, "k:9092", "model: driving through a gateway"),
        ({"worker_url": "http://w"}, None, "bootstrap"),
    ],
)
def test_drive_needs_one_target_and_a_cluster(attach: dict[str, Any], kafka: str | None, error: str) -> None:
    from pipeline.run.config import Attach, RunConfig

    with pytest.raises(ValueError, match=error):
        RunConfig(kafka=KafkaConfig(kafka), attach=Attach(**attach))


def test_drive_plays_against_running_services_with_runs_flags() -> None:
    args = cli.build_parser().parse_args(
        ["drive", "--bootstrap", "k:9092", "--gateway", "http://g", "--model-name", "m", "--rollouts", "4"]
    )
    assert (args.gateway_url, args.model, args.rollouts, args.group_size) == ("http://g", "m", 4, 4)


def test_drive_and_run_play_a_tasks_file_group_size_times_each(tmp_path: Path) -> None:
    from pipeline.commands.run import run_config
    from pipeline.run.config import plan_jobs

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        '{"task_id": "sum", "expression": "2 + 3"}\n{"task_id": "prod", "expression": "4 * 5"}\n'
    )
    args = cli.build_parser().parse_args(
        ["drive", "--bootstrap", "k:9092", "--worker", "http://w", "--tasks", str(tasks), "--group-size", "3"]
    )
    config = run_config(args)
    jobs = plan_jobs("run-t", rollouts=config.rollouts, group_size=3, seed=0, tasks=config.tasks)
    assert config.rollouts == 6 and [j.group_id for j in jobs] == ["run-t.sum"] * 3 + ["run-t.prod"] * 3
    assert jobs[0].task.expression == "2 + 3"
