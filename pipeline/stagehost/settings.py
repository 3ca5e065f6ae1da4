"""Every setting of one ``tokentrail stage`` process, written once.

The verb's flags, their help and the command line a run gives its stage children all
come from this model (``pipeline.process.flags``); the Kafka connection and the log
format travel with their own flags (``pipeline.kafka.config``, ``pipeline.process.jsonlog``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.dataplane.config import AddressesFlag
from pipeline.kafka.consumer import DEFAULT_TUNING, ConsumerTuning
from pipeline.process.datadir import DEFAULT_DATA_DIR
from pipeline.process.flags import Flag
from pipeline.stagehost.lag import DEFAULT_INTERVAL_S
from stages.finalize.janitor import JanitorConfig
from stages.finalize.retain import DEFAULT_BUDGET_BYTES, TRAINER_GROUP
from stages.finalize.verify import MixedVersionPolicy
from stages.ledger.closed import DEFAULT_BUDGET_BYTES as DEFAULT_CLOSED_BUDGET_BYTES
from stages.ledger.stage import LedgerConfig
from stages.recent import DEFAULT_REMEMBER
from stages.specs import StageSettings, staging_ttl

StageName = Literal["ledger", "finalizer"]
"""The keys of ``stages.specs.STAGES`` (a unit test holds them equal)."""
StageDataPlaneMode = Literal["attach", "ray", "embedded"]
METRICS = "metrics"
BOUNDS = "stage bounds"
RETAIN_DIR_NAME = "retained-samples"
MIB = 2**20


class StageBounds(BaseModel):
    """What a long-lived stage keeps of finished rollouts, each bounded (DESIGN §7.9): flags
    of ``tokentrail stage``, and of ``tokentrail run``, which passes them on to its stages."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    remember: Annotated[int, Field(ge=0), Flag(group=BOUNDS)] = DEFAULT_REMEMBER
    """rollouts remembered as answered (read back from the output topic's tail when partitions
    are assigned), so duplicated input gets no second outcome"""
    closed_budget_mib: Annotated[float, Field(ge=0), Flag(group=BOUNDS)] = DEFAULT_CLOSED_BUDGET_BYTES / MIB
    """ledger: memory for the call ids of recently closed rollouts (~330 bytes a 16-call
    rollout), by which a late event is told from a duplicate; over it the oldest are forgotten"""
    retain_samples_bytes: Annotated[int, Field(ge=0), Flag(group=BOUNDS)] = DEFAULT_BUDGET_BYTES
    """finalizer: memory for copies of samples their owners have not acknowledged; over it the
    oldest are let go, counted (0: keep none)"""

    @property
    def closed_budget_bytes(self) -> int:
        return round(self.closed_budget_mib * MIB)

    @property
    def bounds(self) -> StageBounds:
        """These settings alone, of a model that has more (a run's)."""
        return StageBounds.model_validate({name: getattr(self, name) for name in StageBounds.model_fields})


class StageHostSettings(StageBounds):
    """One stage process: which stage, its group, its stage knobs, its data plane, its metrics."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: Annotated[StageName, Flag(positional=True)]
    """which stage"""
    group: str | None = None
    """consumer group (default: tokentrail-<stage>)"""
    seal_grace_s: Annotated[float, Field(gt=0), Flag("--seal-grace")] = LedgerConfig().seal_grace_s
    """ledger: seconds a seal waits"""
    max_open_s: Annotated[float, Field(gt=0), Flag("--max-open")] = LedgerConfig().max_open_s
    """ledger: seconds before an unsealed rollout closes"""
    staging_ttl_s: Annotated[float | None, Field(gt=0), Flag("--staging-ttl")] = None
    """finalizer: seconds after which a staging row nobody finished is deleted (default: twice
    --max-open plus --seal-grace, so no rollout that can still close loses a row)"""
    staging_sweep_s: Annotated[float, Field(gt=0), Flag("--staging-sweep")] = JanitorConfig().sweep_every_s
    """finalizer: seconds between sweeps of the staging partition"""
    mixed_versions: MixedVersionPolicy = MixedVersionPolicy.ALLOW
    """finalizer: policy for samples mixing weight versions"""
    all_or_nothing: bool = False
    """finalizer: under a multi-sample policy, one rejected chain rejects every sample of its
    rollout, for rollouts whose seal does not say (default: each chain stands alone)"""
    sample_owner: Annotated[list[str] | None, Flag(metavar="GROUP")] = Field(
        default=None,
        description=(
            "finalizer: a consumer group that owns the samples; a copy of each sample is kept until every "
            "owner committed past its outcome, and put back into a restarted data plane (repeatable; "
            f"default {TRAINER_GROUP})"
        ),
    )
    retain_dir: Path | None = None
    """finalizer: where the copies of unacknowledged samples are spooled, so that a restarted
    finalizer still has them (default: DATA_DIR/retained-samples)"""
    dataplane_mode: StageDataPlaneMode = "attach"
    """attach: to a local data plane through its address file; ray: to TransferQueue on a Ray
    cluster; embedded: own one in this process (tests)"""
    dataplane_addresses: AddressesFlag = None
    data_dir: Path = DEFAULT_DATA_DIR
    """where dataplane.json lives"""
    ray_address: str | None = None
    """Ray cluster address for --dataplane-mode ray"""
    session_timeout_ms: Annotated[int, Field(gt=0)] = DEFAULT_TUNING.session_timeout_ms
    """consumer group session timeout"""
    heartbeat_ms: Annotated[int, Field(gt=0)] = DEFAULT_TUNING.heartbeat_interval_ms
    """consumer group heartbeat interval"""
    fetch_wait_ms: Annotated[int | None, Field(ge=1)] = DEFAULT_TUNING.fetch_wait_ms
    """how long the broker may hold an empty fetch: latency per hop vs idle CPU (default: the
    broker kind's, ``pipeline.kafka.profile``)"""
    instance_id: str | None = None
    """a name this member keeps across restarts (one per member of the group): on Kafka it joins
    as a static member, so a restart within the session timeout causes no rebalance"""
    merge_margin_ms: Annotated[int, Field(ge=0)] = DEFAULT_TUNING.idle_margin_ms
    """ledger: how long after its timestamp a record may reach the log (the log-time merge's
    margin); each event waits about this long while a partition is idle"""
    ready_fd: Annotated[int | None, Field(ge=0), Flag(metavar="FD")] = None
    """write one line to this inherited file descriptor once the group first assigned this member"""
    metrics_port: Annotated[int, Field(ge=0, le=65535), Flag(group=METRICS)] = 0
    """serve /metrics, /healthz and /readyz on this port (default 0: off)"""
    metrics_host: Annotated[str, Flag(group=METRICS)] = "127.0.0.1"
    """address the metrics server binds (0.0.0.0 in a container)"""
    lag_interval: Annotated[float, Field(gt=0), Flag(group=METRICS)] = DEFAULT_INTERVAL_S
    """seconds between consumer-lag readings for the lag gauge"""
    stall_after: Annotated[float, Field(gt=0), Flag(group=METRICS)] = 60.0
    """seconds without a consumer-loop tick before /healthz fails"""

    @property
    def ledger(self) -> LedgerConfig:
        return LedgerConfig(seal_grace_s=self.seal_grace_s, max_open_s=self.max_open_s)

    @property
    def tuning(self) -> ConsumerTuning:
        return replace(
            DEFAULT_TUNING,
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=self.heartbeat_ms,
            fetch_wait_ms=self.fetch_wait_ms,
            idle_margin_ms=self.merge_margin_ms,
        )

    @property
    def stage_settings(self) -> StageSettings:
        """What the stage itself is built with (the finalizer's sample copies come later:
        they need the broker and the data plane)."""
        ledger = self.ledger
        return StageSettings(
            ledger=ledger,
            mixed_versions=self.mixed_versions,
            all_or_nothing=self.all_or_nothing,
            remember=self.remember,
            closed_budget_bytes=self.closed_budget_bytes,
            janitor=JanitorConfig(
                ttl_s=self.staging_ttl_s or staging_ttl(ledger), sweep_every_s=self.staging_sweep_s
            ),
        )

    @property
    def owners(self) -> list[str]:
        return self.sample_owner or [TRAINER_GROUP]

    @property
    def spool_dir(self) -> Path:
        return self.retain_dir or self.data_dir / RETAIN_DIR_NAME
