"""Every setting of one ``tokentrail gateway`` process, written once.

The verb's flags, their help and any command line that starts a gateway come from this
model (``pipeline.process.flags``); the Kafka connection, the credentials and the log
format travel with their own flags (``pipeline.kafka.config``, ``pipeline.auth.arguments``,
``pipeline.process.jsonlog``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.gateway.pacing import Pacing, optional_pacing
from pipeline.gateway.quotas import Quotas
from pipeline.process.flags import Flag
from pipeline.worker import DEFAULT_MAX_BODY_BYTES, MaxBodyBytes
from stages.ledger.stage import LedgerConfig
from topics.records import SamplePolicy

if TYPE_CHECKING:
    from pipeline.auth.credentials import Credentials
    from pipeline.auth.transport import TlsFiles
    from pipeline.gateway.main import GatewayConfig
    from pipeline.kafka.config import KafkaConfig

RECOVERY = "recovery and replicas (a restart reads the log from the gateway's bookmark, not its beginning)"
QUOTAS = "per-rollout quotas (over one: 429 naming it)"
PACING = "pacing (POST /rollouts answers 429 with Retry-After while the trainer is too far behind)"
DEFAULT_QUOTAS = Quotas()


class GatewaySettings(BaseModel):
    """Which workers a gateway serves sessions in front of, and how; each field is a
    ``tokentrail gateway`` flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    workers: Annotated[str, Flag(metavar="URL[,URL...]")]
    """capture workers to forward calls to"""
    host: str = "127.0.0.1"
    """listen address"""
    port: Annotated[int, Field(ge=0, le=65535)] = 8100
    """listen port; 0 picks a free one"""
    session_ttl_s: Annotated[float, Field(gt=0), Flag("--session-ttl", metavar="S")] = 600.0
    """a session idle this long is sealed failed 'abandoned'"""
    remember_sealed: Annotated[int, Field(gt=0), Flag(metavar="N")] = 10_000
    """sealed sessions kept, the latest, to show and to answer a later call or seal with 409: the
    gateway's memory beyond its open sessions is at most this many"""
    sample_policy: SamplePolicy = "terminal"
    """which chains of a rollout become samples when its seal does not say: the terminal chain,
    every root-to-leaf chain (leaves), or each root's longest chain (chains, for agents that
    rewrite their history)"""
    replica: Annotated[str | None, Flag(metavar="NAME", group=RECOVERY)] = None
    """this replica's name, one of several behind one address routing by rollout id: a rollout it
    does not hold is taken over from the log when called (default: the only gateway)"""
    max_open_s: Annotated[float, Field(gt=0), Flag("--max-open", metavar="S", group=RECOVERY)] = (
        LedgerConfig().max_open_s
    )
    """the ledger's --max-open: older unsealed rollouts are neither rebuilt nor hold the bookmark back"""
    checkpoint_every_s: Annotated[
        float, Field(gt=0), Flag("--checkpoint-every", metavar="S", group=RECOVERY)
    ] = 30.0
    """how often the bookmark is committed"""
    max_body_bytes: MaxBodyBytes = DEFAULT_MAX_BODY_BYTES
    max_in_flight: Annotated[int, Field(gt=0), Flag(metavar="N", group=QUOTAS)] = DEFAULT_QUOTAS.max_in_flight
    """calls of one rollout running at once"""
    max_calls: Annotated[int, Field(gt=0), Flag(metavar="N", group=QUOTAS)] = DEFAULT_QUOTAS.max_calls
    """calls one rollout makes in all"""
    max_tokens: Annotated[int, Field(gt=0), Flag(metavar="N", group=QUOTAS)] = DEFAULT_QUOTAS.max_tokens
    """tokens one rollout's calls use in all"""
    max_request_bytes: Annotated[int, Field(gt=0), Flag(metavar="N", group=QUOTAS)] = (
        DEFAULT_QUOTAS.max_request_bytes
    )
    """request body bytes one rollout sends in all"""
    worker_slots: Annotated[int | None, Field(ge=0), Flag(metavar="N", group=QUOTAS)] = None
    """calls each worker runs at once, shared fairly among the sessions that want them (a session over
    its share waits, never fails); 0 turns fair shares off (default: learned per worker from its
    measured speed, the batch its engine still serves fast; a session's first call never waits)"""
    max_staleness: Annotated[int | None, Flag(metavar="VERSIONS", group=PACING)] = None
    """admit at most this many weight versions ahead of what the workers serve (default: no pacing)"""
    rollouts_per_step: Annotated[int | None, Flag(metavar="N", group=PACING)] = None
    """rollouts the trainer takes per step (its batch); required with --max-staleness"""

    @model_validator(mode="after")
    def _together(self) -> Self:
        if not self.worker_urls:
            raise ValueError("workers: name at least one worker URL")
        optional_pacing(self.max_staleness, self.rollouts_per_step)  # both or neither, each checked
        return self

    @property
    def worker_urls(self) -> tuple[str, ...]:
        return tuple(url.strip() for url in self.workers.split(",") if url.strip())

    @property
    def pacing(self) -> Pacing | None:
        return optional_pacing(self.max_staleness, self.rollouts_per_step)

    @property
    def quotas(self) -> Quotas:
        return Quotas(self.max_in_flight, self.max_calls, self.max_tokens, self.max_request_bytes)

    def gateway_config(
        self,
        kafka: KafkaConfig,
        credentials: Credentials,
        *,
        tls: TlsFiles | None = None,
        ssl_cafile: Path | None = None,
        insecure_no_auth: bool = False,
    ) -> GatewayConfig:
        """The gateway process's configuration (its replica name is checked there)."""
        from pipeline.gateway.main import GatewayConfig  # the web stack: only once a gateway starts

        return GatewayConfig(
            workers=self.worker_urls,
            kafka=kafka,
            host=self.host,
            port=self.port,
            session_ttl_s=self.session_ttl_s,
            remember_sealed=self.remember_sealed,
            replica=self.replica,
            max_open_s=self.max_open_s,
            checkpoint_every_s=self.checkpoint_every_s,
            sample_policy=self.sample_policy,
            max_body_bytes=self.max_body_bytes,
            credentials=credentials,
            quotas=self.quotas,
            worker_slots=self.worker_slots,
            pacing=self.pacing,
            insecure_no_auth=insecure_no_auth,
            tls=tls,
            ssl_cafile=ssl_cafile,
        )
