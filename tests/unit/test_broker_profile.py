"""Which broker a process talks to, and what the client code asks of each: the profile
reaches child processes, retries follow Kafka's retriable flag, and the embedded broker's
deviations stay with it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace

import pytest
from aiokafka.errors import (
    InvalidTopicError,
    KafkaConnectionError,
    MessageSizeTooLargeError,
    NotEnoughReplicasError,
    NotLeaderForPartitionError,
    UnknownError,
)

from pipeline import cli
from pipeline.kafka.config import (
    BROKER_KINDS,
    KafkaConfig,
    add_kafka_arguments,
    config_from_args,
    kafka_arguments,
)
from pipeline.kafka.consumer import DEFAULT_TUNING, ConsumerLoop, ConsumerTuning
from pipeline.kafka.embedded.broker import BrokerError, EmbeddedBroker
from pipeline.kafka.embedded.tansu import EMBEDDED_CLUSTER_PREFIX, TANSU
from pipeline.kafka.kind import profile_of_cluster
from pipeline.kafka.producer import _send_again
from pipeline.kafka.profile import KAFKA
from pipeline.run.config import RunConfig
from pipeline.stagehost.processes import StageOptions, stage_command
from stages.ledger.stage import LedgerConfig


def parsed_config(argv: list[str]) -> KafkaConfig:
    parser = argparse.ArgumentParser()
    add_kafka_arguments(parser, bootstrap_required=True)
    return config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize(("kind", "profile"), [("kafka", KAFKA), ("tansu", TANSU), ("auto", None)])
def test_the_broker_kind_is_a_flag_and_reaches_a_child_process(kind: str, profile: object) -> None:
    config = parsed_config(["--bootstrap", "k:9092", "--broker-kind", kind])
    assert config.broker is profile
    assert parsed_config(kafka_arguments(config)) == config


def test_an_attach_asks_the_broker_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    assert parsed_config(["--bootstrap", "k:9092"]).broker is None
    with pytest.raises(SystemExit):
        parsed_config(["--bootstrap", "k:9092", "--broker-kind", "redpanda"])
    assert "--broker-kind" in capsys.readouterr().err


def test_the_embedded_brokers_cluster_ids_tell_it_from_kafka() -> None:
    assert profile_of_cluster(f"{EMBEDDED_CLUSTER_PREFIX}1baae845f34b") is TANSU
    assert profile_of_cluster("MkU3OEVBNTctOEUyRi00") is KAFKA  # Kafka's: a base64 UUID
    assert profile_of_cluster(None) is KAFKA
    with pytest.raises(BrokerError, match="cluster_id: must start with"):
        EmbeddedBroker(cluster_id="mine")


def test_kafka_is_the_default_contract_and_the_embedded_broker_departs_from_it_in_each_trait() -> None:
    assert (KAFKA.idempotent_producer, KAFKA.static_membership, KAFKA.exact_list_offsets) == (
        True,
        True,
        True,
    )
    assert not KAFKA.unknown_error_is_write_conflict
    assert set(BROKER_KINDS) == {"kafka", "tansu"}
    traits = (
        "idempotent_producer",
        "static_membership",
        "unknown_error_is_write_conflict",
        "exact_list_offsets",
    )
    assert all(getattr(KAFKA, trait) != getattr(TANSU, trait) for trait in traits)
    assert TANSU.fetch_wait_ms < KAFKA.fetch_wait_ms


@pytest.mark.parametrize(
    ("error", "on_kafka", "on_embedded"),
    [
        (NotLeaderForPartitionError(), True, True),  # retriable: a leader moved
        (NotEnoughReplicasError(), True, True),
        (UnknownError(), False, True),  # the embedded broker's write conflict only
        (KafkaConnectionError(), False, False),  # unreachable: the stage waits it out
        (InvalidTopicError(), False, False),
        (MessageSizeTooLargeError(), False, False),
        (ValueError("bug"), False, False),
    ],
)
def test_a_record_is_sent_again_only_for_an_error_kafka_calls_retriable(
    error: BaseException, on_kafka: bool, on_embedded: bool
) -> None:
    assert (_send_again(KAFKA, error), _send_again(TANSU, error)) == (on_kafka, on_embedded)


def test_the_fetch_wait_is_the_broker_kinds_unless_given() -> None:
    assert DEFAULT_TUNING.fetch_wait_ms is None and RunConfig().fetch_wait_ms is None
    options = StageOptions(ledger=LedgerConfig(), tuning=DEFAULT_TUNING)
    argv = stage_command("ledger", KafkaConfig(bootstrap_servers="h:1"), options)
    assert "--fetch-wait-ms" not in argv
    given = StageOptions(ledger=LedgerConfig(), tuning=replace(DEFAULT_TUNING, fetch_wait_ms=40))
    argv = stage_command("ledger", KafkaConfig(bootstrap_servers="h:1"), given)
    assert cli.build_parser().parse_args(argv[3:]).fetch_wait_ms == 40


def test_a_stage_takes_a_stable_instance_id() -> None:
    base = ["stage", "ledger", "--bootstrap", "b:9092"]
    assert cli.build_parser().parse_args(base).instance_id is None
    assert cli.build_parser().parse_args([*base, "--instance-id", "ledger-0"]).instance_id == "ledger-0"


def test_static_membership_and_the_fetch_wait_follow_the_broker(
    unconnected_loop: Callable[..., ConsumerLoop],
) -> None:
    def loop(instance_id: str | None, tuning: ConsumerTuning = DEFAULT_TUNING) -> ConsumerLoop:
        return unconnected_loop(tuning, instance_id=instance_id)

    named, anonymous = loop("ledger-0"), loop(None)
    assert named._broker_settings(KAFKA) == {"group_instance_id": "ledger-0", "fetch_max_wait_ms": 500}
    assert named._broker_settings(TANSU) == {"fetch_max_wait_ms": TANSU.fetch_wait_ms}
    assert anonymous._broker_settings(KAFKA) == {"fetch_max_wait_ms": KAFKA.fetch_wait_ms}
    assert loop(None, replace(DEFAULT_TUNING, fetch_wait_ms=40))._broker_settings(KAFKA) == {
        "fetch_max_wait_ms": 40
    }
