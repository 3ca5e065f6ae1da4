"""Several samples per rollout, on the real broker and the real data plane.

Rollouts whose calls form trees (branches), rewritten histories (a second root) and
retries are captured through the real capture core into TransferQueue, their events go
through the tansu broker, and the ledger and finalizer stages consume them as they do
in production. Each sample is checked token for token against the tokens the rollout
was built from.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from scenariokit import SCENARIOS, capture, capturing, chain_tokens

from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import compare, materialize, read_log, rebuild
from pipeline.replay.store import LedgerStore
from pipeline.stagehost.runner import serve_stage
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.specs import FINALIZER, LEDGER
from topics import digest
from topics.names import TopicNames
from topics.records import FinalizedEvent, TrainingSample

pytestmark = [pytest.mark.broker, pytest.mark.dataplane]


@dataclass(slots=True)
class Outcome:
    call_ids: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per rollout: node name -> call id."""
    finalized: dict[str, list[FinalizedEvent]] = field(default_factory=dict)
    samples: dict[str, TrainingSample] = field(default_factory=dict)
    staging_left: list[str] = field(default_factory=list)
    replay_differences: list[str] = field(default_factory=list)


async def run_pipeline(server: EmbeddedDataPlane, config: KafkaConfig, tmp: Path) -> Outcome:
    outcome = Outcome()
    await ensure_topics(config)
    async with (
        await TransferQueueDataPlane.attach(server.addresses, timeout_s=20.0) as plane,
        KafkaEventSink(config) as sink,
    ):
        async with capturing(plane, sink, "w0") as (core, client):
            for name, scenario in SCENARIOS.items():
                outcome.call_ids[name] = await capture(core, client, plane, name, scenario)

        stop = asyncio.Event()
        ledger = LedgerStage(sink, LedgerConfig(seal_grace_s=30))
        finalizer = FinalizerStage(plane, sink)
        tasks = [
            asyncio.create_task(serve_stage(stage, spec, config, sink, stop=stop, tuning=FAST_GROUPS))
            for stage, spec in ((ledger, LEDGER), (finalizer, FINALIZER))
        ]
        deadline = time.monotonic() + 90
        while len(finalizer.answered) < len(SCENARIOS) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)

        async for batch, _, _ in read_log(config, [config.names.finalized]):
            for item in batch:
                event = item.event.payload
                assert isinstance(event, FinalizedEvent)
                outcome.finalized.setdefault(event.rollout_id, []).append(event)
        keys = [key for events in outcome.finalized.values() for key in events[0].sample_keys]
        outcome.samples = await plane.get_samples(keys)
        outcome.staging_left = await plane.list_keys("staging")
    with LedgerStore(tmp / "rebuilt.sqlite") as rebuilt, LedgerStore(tmp / "live.sqlite") as live:
        await rebuild(config, rebuilt, ledger=LedgerConfig(seal_grace_s=30))
        await materialize(config, live)
        outcome.replay_differences = compare(rebuilt, live)
    return outcome


@pytest.fixture(scope="module")
def outcome(kafka_broker: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    kafka_broker.check()
    config = kafka_broker.kafka_config(
        TopicNames(prefix=f"t{uuid.uuid4().hex[:12]}", partitions=4), client_id="tokentrail-test"
    )
    with EmbeddedDataPlane.start() as server:
        yield asyncio.run(run_pipeline(server, config, tmp_path_factory.mktemp("replay")))


def finalized(outcome: Outcome, rollout_id: str) -> FinalizedEvent:
    events = outcome.finalized[rollout_id]
    assert len(events) == 1, f"{rollout_id}: {len(events)} outcomes"
    return events[0]


def assert_exact(outcome: Outcome, rollout_id: str, leaf: str) -> TrainingSample:
    """The sample of the chain ending at ``leaf`` is stored and equals the built tokens."""
    call_id = outcome.call_ids[rollout_id][leaf]
    key = f"{rollout_id}@{call_id}"
    sample = outcome.samples[key]
    assert sample.sample_key == key  # read back from the data plane with its own key
    ids, mask, logprobs = chain_tokens(SCENARIOS[rollout_id].nodes, leaf)
    assert (sample.token_ids, sample.token_mask, sample.logprobs) == (ids, mask, logprobs)
    assert sample.cumulative_hash == digest.cumulative_hash(ids)
    assert sample.spans[-1].call_id == call_id and sample.reward == 1.0 and sample.group_id == "g"
    return sample


def outcomes_by_leaf(outcome: Outcome, rollout_id: str) -> dict[str, str]:
    """Leaf node name -> the sample's status (or rejection code)."""
    names = {call_id: name for name, call_id in outcome.call_ids[rollout_id].items()}
    return {
        names[sample.leaf_call_id]: sample.rejection_reason or sample.status
        for sample in finalized(outcome, rollout_id).samples
    }


def test_a_tree_under_terminal_is_ambiguous(outcome: Outcome) -> None:
    event = finalized(outcome, "tree-terminal")
    assert (event.status, event.rejection_reason, event.samples) == ("rejected", "ambiguous_terminal", [])


def test_a_tree_under_leaves_gives_one_exact_sample_per_leaf(outcome: Outcome) -> None:
    event = finalized(outcome, "tree-leaves")
    assert event.status == "accepted" and event.sample_policy == "leaves"
    assert outcomes_by_leaf(outcome, "tree-leaves") == {"a2": "accepted", "b": "accepted", "c2": "accepted"}
    samples = [assert_exact(outcome, "tree-leaves", leaf) for leaf in ("a2", "b", "c2")]
    assert event.total_len == sum(len(s.token_ids) for s in samples)
    assert event.generated_tokens == sum(int(sum(s.token_mask)) for s in samples)


def test_a_history_rewritten_at_turn_4_gives_two_samples_under_chains(outcome: Outcome) -> None:
    assert outcomes_by_leaf(outcome, "rewritten-chains") == {"t3": "accepted", "t6": "accepted"}
    first = assert_exact(outcome, "rewritten-chains", "t3")
    assert 77 not in first.token_ids  # the abandoned retry of turn 2 is in no sample
    second = assert_exact(outcome, "rewritten-chains", "t6")
    # The seal's per-call rewards, through the broker, the ledger and the finalizer, on the
    # spans of the calls they name (read back from the data plane).
    assert [span.reward for span in first.spans] == [None, None, 0.3]
    assert [span.reward for span in second.spans] == [None, None, 0.6]


def test_retries_collapse_and_branches_stay(outcome: Outcome) -> None:
    assert outcomes_by_leaf(outcome, "retried-leaves") == {"t3": "accepted", "b": "accepted"}
    assert_exact(outcome, "retried-leaves", "t3")
    assert_exact(outcome, "retried-leaves", "b")


def test_a_corrupted_row_rejects_only_its_branch(outcome: Outcome) -> None:
    event = finalized(outcome, "corrupt-leaves")
    assert event.status == "accepted"
    assert outcomes_by_leaf(outcome, "corrupt-leaves") == {
        "a2": "accepted",
        "b": "digest_mismatch",
        "c2": "accepted",
    }
    assert_exact(outcome, "corrupt-leaves", "a2")
    assert_exact(outcome, "corrupt-leaves", "c2")
    assert event.sample_keys == [s.sample_key for s in event.samples if s.status == "accepted"]


def test_all_or_nothing_rejects_every_branch_with_the_failing_code(outcome: Outcome) -> None:
    event = finalized(outcome, "corrupt-all-or-nothing")
    assert (event.status, event.rejection_reason) == ("rejected", "digest_mismatch")
    assert outcomes_by_leaf(outcome, "corrupt-all-or-nothing") == {
        "a2": "branch_rejected",
        "b": "digest_mismatch",
        "c2": "branch_rejected",
    }
    assert not [key for key in outcome.samples if key.startswith("corrupt-all-or-nothing@")]


def test_every_staging_row_is_deleted_once_finalized(outcome: Outcome) -> None:
    assert len(outcome.finalized) == len(SCENARIOS)
    assert [key for key in outcome.staging_left if key.split("/")[0] in SCENARIOS] == []


def test_replay_rebuilds_the_multi_sample_receipts(outcome: Outcome) -> None:
    assert outcome.replay_differences == []
