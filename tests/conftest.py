"""Fixtures for tests that need real infrastructure.

One real tansu broker (memory engine, random free port) serves the whole session, and
so does a second broker that keeps Kafka's contract (``contractbroker``) for the tests
that ask for it; each test gets its own topic prefix and therefore its own topics and
groups, so tests never see each other's events. A module that asks for ``host`` gets its own vLLM CPU
engine on the tiny model (``model_dir``), freed when the module ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from contractbroker import contract_broker

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import (
    DEFAULT_TUNING,
    FAST_GROUPS,
    CollectingHandler,
    ConsumerLoop,
    ConsumerTuning,
)
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.profile import KAFKA
from pipeline.process.guard import guard_descendants
from stages.memory import RecordingSink
from topics.names import TopicNames

if TYPE_CHECKING:  # the engine kit imports vLLM: only the modules that ask for it load it
    from enginekit import EngineHost, HFOracle
    from familykit import FamilyEngines


def pytest_configure(config: pytest.Config) -> None:
    """Whatever the tests start dies with the test run, even if it is killed outright."""
    guard_descendants()


ENGINE_POOLS = ("tests/families/", "tests/frameworks/")
"""Where the tests share one pool of vLLM engines (``family_engines``)."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How ``make test`` splits the suite between xdist workers: a module's tests stay on one
    worker (its module fixtures start once), and the tests sharing the engine pool run on one
    worker, so each of its engines starts once, not once per worker. Work goes out in the
    order collected, not xdist's most-tests-first: that order sent the modules of one long
    test (a run killed and restarted, the walkthrough, the soak) last, where one worker
    waited minutes for the other; collected, the many short unit modules come last instead."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ByModuleAndEnginePool(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "engine-pool" if module.startswith(ENGINE_POOLS) else module

    return ByModuleAndEnginePool(config, log)


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(storage="memory") as broker:
        yield broker


@pytest.fixture(scope="session")
def contract_bootstrap() -> Iterator[str]:
    with contract_broker() as bootstrap:
        yield bootstrap


@pytest.fixture
def contract_config(contract_bootstrap: str, topic_names: TopicNames) -> KafkaConfig:
    """A config for the Kafka-contract broker with Kafka's profile, as an attach states it."""
    return KafkaConfig(contract_bootstrap, client_id="tokentrail-test", names=topic_names, broker=KAFKA)


@pytest.fixture(params=["embedded", "contract"])
def either_config(request: pytest.FixtureRequest) -> KafkaConfig:
    """The embedded broker's config, then the Kafka-contract broker's: for the tests that
    must hold on both (the client code takes each one's profile)."""
    config: KafkaConfig = request.getfixturevalue(
        "kafka_config" if request.param == "embedded" else "contract_config"
    )
    return config


@pytest.fixture
def topic_names() -> TopicNames:
    return TopicNames(prefix=f"t{uuid.uuid4().hex[:12]}", partitions=4)


@pytest.fixture
def kafka_config(kafka_broker: EmbeddedBroker, topic_names: TopicNames) -> KafkaConfig:
    kafka_broker.check()
    return kafka_broker.kafka_config(topic_names, client_id="tokentrail-test")


@pytest.fixture
def fast_group() -> ConsumerTuning:
    """Short consumer-group timeouts: tansu holds a group join for half the session timeout."""
    return FAST_GROUPS


@pytest.fixture
def unconnected_loop() -> Callable[..., ConsumerLoop]:
    """Consumer loops that are never started (no broker): for their bookkeeping alone."""

    def make(
        tuning: ConsumerTuning = DEFAULT_TUNING,
        log_time_order: list[str] | None = None,
        instance_id: str | None = None,
    ) -> ConsumerLoop:
        return ConsumerLoop(
            KafkaConfig("127.0.0.1:1"),
            group_id="g",
            topics=["t"],
            handler=CollectingHandler(),
            dead_letters=RecordingSink(),
            stage="test",
            tuning=tuning,
            log_time_order=log_time_order,
            instance_id=instance_id,
        )

    return make


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the real vLLM engine, one for the whole session (``enginekit``) --------------------
# Starting an engine costs more than most tests that use it, so the modules that ask for
# ``host`` share one; a test that changes its weights or version restores them.


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed-0 tiny model (ChatML template), built offline."""
    from pipeline.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "chatml", seed=0)


@pytest.fixture(scope="session")
def family_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyEngines]:
    """Each template family's engine, shared by the family and framework matrices."""
    from familykit import FamilyEngines

    engines = FamilyEngines(tmp_path_factory.mktemp("families"))
    try:
        yield engines
    finally:
        engines.close()


@pytest.fixture(scope="session")
def host(model_dir: Path) -> Iterator[EngineHost]:
    """A vLLM CPU engine on ``model_dir``, on its own thread's event loop."""
    from enginekit import EngineHost

    from stages.capture.vllm.engine import EngineSettings

    engine_host = EngineHost(EngineSettings(model=str(model_dir)))
    try:
        yield engine_host
    finally:
        engine_host.close()


@pytest.fixture(scope="module")
def oracle() -> HFOracle:
    """A Hugging Face forward of the same models: the independent check of every sample."""
    from enginekit import HFOracle

    return HFOracle()
