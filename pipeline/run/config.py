"""What one ``tokentrail run`` does: its settings, its run id and the rollouts it plays.

Rollout ids start with the run id, so runs that share a data directory (and therefore
a durable event log whose stages resume from committed offsets) never collide: a
second run adds new rollouts and never re-finalizes an old one. Groups are GRPO
groups: each task is played ``group_size`` times under one ``group_id``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, model_validator

from pipeline.dataplane.config import AddressesFlag
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import DEFAULT_TUNING
from pipeline.kafka.embedded.broker import StorageMode
from pipeline.process.datadir import DEFAULT_DATA_DIR
from pipeline.process.flags import NOT_A_FLAG, Flag
from pipeline.stagehost.settings import StageBounds
from pipeline.worker.reasoning import AUTO
from pipeline.worker.tokenizer_mode import TOKENIZER_MODES
from stages.driver import Job
from stages.envs.arithmetic import RewardKind, Task, make_tasks, read_tasks
from stages.ledger.stage import LedgerConfig
from stages.trainer.settings import TrainerDtype
from stages.trainer.staleness import StaleMeasure

RunDataPlaneMode = Literal["embedded", "ray"]
TINY_MODEL_DIR_NAME = "tiny-model"


AgentKind = Literal["driver", "sdk"]
StageHosting = Literal["processes", "inline"]
TrainerKind = Literal["builtin", "trl"]


class Attach(BaseModel):
    """The running services ``tokentrail drive`` plays against: its own flags."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    worker_url: Annotated[str | None, Flag("--worker", metavar="URL")] = None
    """a capture worker: the built-in driver plays against it"""
    gateway_url: Annotated[str | None, Flag("--gateway", metavar="URL")] = None
    """a gateway: an agent that only uses the openai SDK plays through it"""
    model: Annotated[str | None, Flag("--model-name")] = None
    """the model the workers serve (required with --gateway)"""
    dataplane_addresses: AddressesFlag = None
    credentials_dir: Annotated[Path | None, NOT_A_FLAG] = None
    """The cluster's role secrets, one file each (``--credentials-dir``); ``TOKENTRAIL_*`` variables override them."""

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.worker_url is None) == (self.gateway_url is None):
            raise ValueError("worker_url: give it or --gateway, one of them")
        if self.gateway_url is not None and self.model is None:
            raise ValueError("model: driving through a gateway needs the served model's name")
        return self


ROLLOUTS = "rollouts"
TIMING = "timing"
LEDGER = "ledger"
SERVICES = "services"
TRAINING = "training (the closed RL loop)"
SAMPLING_FILTER = "; recorded on every call and replayed by the trainers (default: not sent, so the model's generation_config.json, if any, decides)"


def read_tasks_file(path: str) -> tuple[Task, ...]:
    """``--tasks FILE``: its tasks, each checked (``TaskFileError`` names the bad line)."""
    with Path(path).open() as lines:
        return tuple(read_tasks(lines, path))


class RunConfig(StageBounds):
    """Every setting of a run; the defaults are the single-machine demo (``make run``).

    Each field is also its ``tokentrail run`` flag (``pipeline.process.flags``): its
    docstring is the flag's help. The stage bounds are the stages' own fields, passed on."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    data_dir: Path = DEFAULT_DATA_DIR
    """broker store, tiny model, data-plane addresses and samples archive"""
    model_dir: Annotated[Path | None, Flag("--model", metavar="DIR")] = None
    """model directory to serve (default: the tiny model in DATA_DIR/tiny-model, built if missing)"""
    reasoning_parser: Annotated[str, Flag(metavar="NAME")] = AUTO
    """the worker's vLLM reasoning parser; auto: the one that fits the model's template family
    (qwen3, deepseek_r1, openai_gptoss), if it reasons; none: off"""
    tokenizer_mode: Annotated[str, Flag(choices=TOKENIZER_MODES)] = AUTO
    """the worker's: mistral: chat through mistral_common, as vLLM serves Mistral models; auto:
    mistral where that is the model's only chat format, else its chat template"""
    tasks: Annotated[
        tuple[InstanceOf[Task], ...] | None, Flag(metavar="FILE", group=ROLLOUTS, parse=read_tasks_file)
    ] = None
    """play these tasks instead of generated ones: JSON lines {"task_id": ..., "expression": ...},
    each played --group-size times (--rollouts is then their number times the group size)"""
    reward: Annotated[RewardKind, Flag(group=ROLLOUTS)] = "answer"
    """how generated tasks are scored: their final answer, or the share of digits in the
    replies (dense: the learning curves' reward)"""
    rollouts: Annotated[int, Flag(group=ROLLOUTS)] = 8
    """rollouts to play"""
    group_size: Annotated[int, Flag(group=ROLLOUTS)] = 4
    """GRPO group size: each task is played this many times"""
    turns: Annotated[int, Flag(group=ROLLOUTS)] = 3
    """model calls per rollout, at most"""
    concurrency: Annotated[int, Flag(group=ROLLOUTS)] = 4
    """rollouts in flight"""
    max_tokens: Annotated[int, Flag(group=ROLLOUTS)] = 48
    """tokens per model call"""
    temperature: Annotated[float, Flag(group=ROLLOUTS)] = 1.0
    """sampling temperature; 1.0 samples the policy itself, as on-policy RL does"""
    top_p: Annotated[float | None, Flag(group=ROLLOUTS)] = Field(
        default=None,
        description="nucleus sampling: keep the most likely tokens up to this mass" + SAMPLING_FILTER,
    )
    top_k: Annotated[int | None, Flag(group=ROLLOUTS)] = Field(
        default=None, description="keep the K most likely tokens" + SAMPLING_FILTER
    )
    min_p: Annotated[float | None, Flag(group=ROLLOUTS)] = Field(
        default=None,
        description="keep tokens at least this fraction as likely as the most likely one" + SAMPLING_FILTER,
    )
    seed: Annotated[int, Flag(group=ROLLOUTS)] = 0
    """task, sampling and engine seed"""
    finalize_timeout_s: Annotated[float, Flag("--timeout", group=TIMING)] = 600.0
    """seconds to wait for every rollout's FinalizedEvent after driving"""
    lag_timeout_s: Annotated[float, Flag("--lag-timeout", group=TIMING)] = 60.0
    """seconds to wait for consumer lag 0"""
    seal_grace_s: Annotated[float, Flag("--seal-grace", group=LEDGER)] = 10.0
    """seconds a seal waits for calls in flight"""
    max_open_s: Annotated[float, Flag("--max-open", group=LEDGER)] = 600.0
    """seconds before an unsealed rollout is closed"""
    fetch_wait_ms: Annotated[int | None, Flag(group=LEDGER)] = DEFAULT_TUNING.fetch_wait_ms
    """how long the broker may hold the stages' fetches (ConsumerTuning.fetch_wait_ms); on the
    embedded broker's memory storage a longer wait lets them read longer partitions (DESIGN §3);
    default: the broker kind's"""
    broker_storage: Annotated[StorageMode, Flag(group=SERVICES)] = "durable"
    """embedded broker storage: durable in DATA_DIR, or memory"""
    dataplane_mode: Annotated[RunDataPlaneMode, Flag(group=SERVICES)] = "embedded"
    """embedded TransferQueue in this process, or TransferQueue on a Ray cluster"""
    ray_address: Annotated[str | None, Flag(group=SERVICES)] = None
    """Ray cluster address for --dataplane-mode ray (e.g. auto)"""
    stages: Annotated[StageHosting, Flag(group=SERVICES)] = "processes"
    """the ledger and finalizer as `tokentrail stage` child processes, a core each, or as tasks
    on this process's event loop"""
    agent: AgentKind = "driver"
    """who plays the rollouts: the built-in driver (it builds admissions itself), or an agent
    using only the openai SDK through a gateway (which builds them)"""
    train_steps: Annotated[int, Flag(metavar="N", group=TRAINING)] = 0
    """play --rollouts rollouts, take one GRPO step on the model with their samples, load the new
    weights into the worker, N times; the JSON adds train_steps (0: no training)"""
    trainer: Annotated[TrainerKind, Flag(group=TRAINING)] = "builtin"
    """who takes each step: the built-in GRPO step, or TRL's GRPOTrainer"""
    learning_rate: Annotated[float, Flag(group=TRAINING)] = 1e-2
    """SGD step size"""
    max_staleness: Annotated[int | None, Flag(metavar="VERSIONS", group=TRAINING)] = None
    """let generation run ahead of the trainer (either) by at most this many weight versions,
    pacing new rollouts and dropping samples further behind;
    default: play each step, then train (staleness 0)"""
    staleness_measure: Annotated[StaleMeasure, Flag(group=TRAINING)] = "oldest"
    """a sample's version for staleness: its oldest token's, newest's or admission's"""
    trainer_delay_s: Annotated[float, Flag(metavar="SECONDS", group=TRAINING)] = 0.0
    """a deliberately slow trainer: sleep this long before each built-in step"""
    trainer_dtype: Annotated[TrainerDtype, Flag(group=TRAINING)] = "float32"
    """the trainer's weights (either trainer); bfloat16 against the fp32 engine shows a precision
    mismatch in each step's report"""
    shift_behaviour_temperature: Annotated[float | None, Flag(metavar="T", group=TRAINING)] = None
    """benchmark only: the trainer is told every call sampled at temperature T, so the captured
    logprobs are of a wrong temperature to it (shows what the importance correction does)"""
    keep: bool = False
    """after the run, keep broker, data plane, worker and stages serving until Ctrl-C"""
    kafka: Annotated[InstanceOf[KafkaConfig], NOT_A_FLAG] = Field(default_factory=KafkaConfig)
    """``bootstrap_servers=None`` starts the embedded broker in ``data_dir`` (its own flags)."""
    run_id: Annotated[str | None, NOT_A_FLAG] = None
    attach: Annotated[InstanceOf[Attach] | None, NOT_A_FLAG] = None
    """``tokentrail drive``: play against services already running instead of starting them."""

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling options every model call sends: the temperature, and the filters given.
        A filter not given is not sent, so the engine's defaults apply; whatever it samples
        with is recorded on each call (DESIGN §4.7)."""
        options: dict[str, Any] = {"temperature": self.temperature}
        for name in ("top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    @model_validator(mode="after")
    def _runnable(self) -> Self:
        for name in ("rollouts", "group_size", "turns", "concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.rollouts % self.group_size:
            raise ValueError(
                f"rollouts: {self.rollouts} is not a multiple of the group size {self.group_size} "
                "(every task is played group-size times)"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0: off), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.attach is not None and (self.embedded_broker or self.train_steps or self.keep):
            raise ValueError(
                "attach: driving running services needs --bootstrap, and trains or keeps nothing"
            )
        if self.tasks is not None and (
            self.train_steps or len(self.tasks) * self.group_size != self.rollouts
        ):
            raise ValueError("tasks: play each task group-size times, once (no --train-steps)")
        if self.tasks is not None and self.reward != "answer":
            raise ValueError("reward: scores generated tasks; a --tasks file is scored by its answers")
        if self.trainer == "trl" and not self.train_steps:
            raise ValueError("trainer: trl trains only with --train-steps N")
        if self.train_steps < 0:
            raise ValueError(f"train_steps: must be >= 0, got {self.train_steps}")
        if self.train_steps and self.keep:
            raise ValueError("train_steps: a training run does not --keep serving")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.max_staleness is not None and not self.train_steps:
            raise ValueError("max_staleness: paces (and drops) the samples of --train-steps only")
        if not self.trainer_delay_s >= 0:
            raise ValueError(f"trainer_delay_s: must be >= 0, got {self.trainer_delay_s}")
        if self.trainer_delay_s and (not self.train_steps or self.trainer != "builtin"):
            raise ValueError("trainer_delay_s: slows the built-in trainer's --train-steps only")
        if self.shift_behaviour_temperature is not None and not (
            self.train_steps and self.shift_behaviour_temperature > 0
        ):
            raise ValueError(
                "shift_behaviour_temperature: must be > 0, and shifts only what --train-steps trains"
            )
        kept = StageBounds.model_fields["retain_samples_bytes"].default
        if self.dataplane_mode == "embedded" and self.retain_samples_bytes != kept:
            raise ValueError(
                "retain_samples_bytes: the embedded data plane ends with the run, so its finalizer keeps "
                "no sample copies; it applies with --dataplane-mode ray"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: must be > 0, got {self.learning_rate}")
        if self.fetch_wait_ms is not None and self.fetch_wait_ms < 1:
            raise ValueError(f"fetch_wait_ms: must be >= 1, got {self.fetch_wait_ms}")
        for name in ("seal_grace_s", "max_open_s", "finalize_timeout_s", "lag_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        # The topics must outlive a rollout left open: in this run's ledger, or (driving a
        # cluster) in one started with tokentrail stage's default.
        self.kafka.retention.check(self.max_open_s if self.attach is None else LedgerConfig().max_open_s)
        return self

    @property
    def total_rollouts(self) -> int:
        """Every rollout the run plays: ``rollouts`` per train step, or once."""
        return self.rollouts * max(1, self.train_steps)

    @property
    def resolved_model_dir(self) -> Path:
        return self.model_dir if self.model_dir is not None else self.data_dir / TINY_MODEL_DIR_NAME

    @property
    def embedded_broker(self) -> bool:
        return self.kafka.embedded


def new_run_id() -> str:
    """Sortable by start time, unique across runs: ``run-YYYYMMDD-HHMMSS-xxxxxx`` (UTC)."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def plan_jobs(
    run_id: str,
    *,
    rollouts: int,
    group_size: int,
    seed: int,
    tasks: Sequence[Task] | None = None,
    reward: RewardKind = "answer",
) -> list[Job]:
    """``rollouts // group_size`` tasks (``tasks``, or generated from ``seed`` and scored by
    ``reward``), each played ``group_size`` times as one group."""
    jobs: list[Job] = []
    for task in tasks if tasks is not None else make_tasks(rollouts // group_size, seed, reward):
        group_id = f"{run_id}.{task.task_id}"
        jobs.extend(Job(f"{group_id}.{member}", task, group_id) for member in range(group_size))
    return jobs
