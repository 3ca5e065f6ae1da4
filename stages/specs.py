"""The consumer stages, in one table: what each reads, writes, and how it is built.

Everything that runs a stage (``tokentrail run``, ``tokentrail stage``, the lag probe,
the benchmarks, the fault harness) looks a stage up here, so a stage's group, input
topics and output topic are written once. The runtime hosts a stage through
``stages.ports.StagePort`` and never names a concrete one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stages.finalize.janitor import JanitorConfig
from stages.finalize.retain import RetainedSamples
from stages.finalize.stage import FinalizerStage
from stages.finalize.verify import MixedVersionPolicy
from stages.ledger.closed import DEFAULT_BUDGET_BYTES as DEFAULT_CLOSED_BUDGET_BYTES
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.ports import DataPlane, EventSink, StagePort
from stages.recent import DEFAULT_REMEMBER
from topics.events import EventType
from topics.names import TopicNames


@dataclass(frozen=True, slots=True)
class StageSettings:
    """Every stage's knobs in one object; each stage reads its own."""

    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    mixed_versions: MixedVersionPolicy = MixedVersionPolicy.ALLOW
    all_or_nothing: bool = False
    """The finalizer's default for multi-sample rollouts whose seal does not say."""
    remember: int = DEFAULT_REMEMBER
    """Rollouts a stage remembers as answered (recalled from its output topic's tail)."""
    closed_budget_bytes: int = DEFAULT_CLOSED_BUDGET_BYTES
    """The ledger's memory for the call ids its recently closed rollouts covered."""
    janitor: JanitorConfig = field(default_factory=JanitorConfig)
    """The finalizer's sweep of staging rows nobody else will delete."""
    retained: RetainedSamples | None = None
    """The finalizer's copies of samples until their owners have them (DESIGN §7.4), built
    by the host, which knows the broker and the data plane; None keeps none."""


def staging_ttl(ledger: LedgerConfig) -> float:
    """How long the janitor leaves a row nobody finished: twice the longest a rollout can
    stay open (unsealed for ``max_open_s``, then sealed for ``seal_grace_s``), so no
    rollout that can still close loses a row (DESIGN §7.3)."""
    return 2 * (ledger.max_open_s + ledger.seal_grace_s)


class MissingDataPlane(ValueError):
    """A stage that reads rows was built without a data plane."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One consumer stage: its name, consumer group, topics, and how to build it.

    ``answer`` is the event type on ``output`` that closes a rollout for this stage: the
    host re-reads those from the output topic's tail to recall what was answered.
    ``log_time_order``: for a stage that decides by log time (grace periods), the input
    topics in the order records of equal timestamp go; its host then hands it events
    merged across partitions in log-time order, as a replay does (DESIGN §7.2).
    ``reads``: the event types the stage acts on, when its inputs carry others too; its
    host passes the others by without decoding them (None: it decodes every record).
    """

    name: str
    group: str
    inputs: Callable[[TopicNames], list[str]]
    output: Callable[[TopicNames], str]
    answer: EventType
    uses_data_plane: bool
    factory: Callable[[EventSink, DataPlane | None, StageSettings], StagePort]
    log_time_order: Callable[[TopicNames], list[str]] | None = None
    reads: frozenset[EventType] | None = None

    def build(
        self, sink: EventSink, data_plane: DataPlane | None = None, settings: StageSettings | None = None
    ) -> StagePort:
        if self.uses_data_plane and data_plane is None:
            raise MissingDataPlane(f"stage {self.name} reads rows: it needs a data plane")
        return self.factory(sink, data_plane, settings or StageSettings())


def _ledger(sink: EventSink, _: DataPlane | None, settings: StageSettings) -> StagePort:
    return LedgerStage(
        sink, settings.ledger, remember=settings.remember, closed_budget_bytes=settings.closed_budget_bytes
    )


def _finalizer(sink: EventSink, data_plane: DataPlane | None, settings: StageSettings) -> StagePort:
    assert data_plane is not None  # StageSpec.build checked it
    return FinalizerStage(
        data_plane,
        sink,
        policy=settings.mixed_versions,
        all_or_nothing=settings.all_or_nothing,
        remember=settings.remember,
        janitor=settings.janitor,
        retained=settings.retained,
    )


LEDGER = StageSpec(
    name="ledger",
    group="tokentrail-ledger",
    inputs=lambda names: [names.admission, names.staged],
    output=lambda names: names.committed,
    answer=EventType.RECEIPT,
    uses_data_plane=False,
    factory=_ledger,
    # A staged event stamped in the seal's millisecond goes first: its worker answered
    # before the driver sealed.
    log_time_order=lambda names: [names.staged, names.admission],
)

FINALIZER = StageSpec(
    name="finalizer",
    group="tokentrail-finalizer",
    inputs=lambda names: [names.committed],
    output=lambda names: names.finalized,
    answer=EventType.FINALIZED,
    uses_data_plane=True,
    factory=_finalizer,
    # The committed topic is mostly call records, the ledger's record of each call: the
    # finalizer works from receipts alone, so decoding the rest was most of its decoding.
    reads=frozenset({EventType.RECEIPT}),
)

STAGES: dict[str, StageSpec] = {spec.name: spec for spec in (LEDGER, FINALIZER)}
"""Every stage, in pipeline order."""
