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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import DEFAULT_TUNING
from pipeline.kafka.embedded.broker import StorageMode
from pipeline.worker.reasoning import AUTO
from stages.driver import Job
from stages.envs.arithmetic import RewardKind, Task, make_tasks
from stages.ledger.stage import LedgerConfig
from stages.trainer.settings import TRAINER_DTYPES, TrainerDtype
from stages.trainer.staleness import StaleMeasure

RunDataPlaneMode = Literal["embedded", "ray"]
DEFAULT_DATA_DIR = Path(".tokentrail")
TINY_MODEL_DIR_NAME = "tiny-model"


AgentKind = Literal["driver", "sdk"]
StageHosting = Literal["processes", "inline"]
TrainerKind = Literal["builtin", "trl"]


@dataclass(frozen=True, slots=True)
class Attach:
    """The running services ``tokentrail drive`` plays against."""

    worker_url: str | None = None
    gateway_url: str | None = None
    """Through a gateway: an agent that only uses the openai SDK plays (``model`` names the model)."""
    model: str | None = None
    dataplane_addresses: Path | None = None
    """Where accepted samples are read back for the archive (None: ``TOKENTRAIL_DATAPLANE_*``)."""
    credentials_dir: Path | None = None
    """The cluster's role secrets, one file each; ``TOKENTRAIL_*`` variables override them."""

    def __post_init__(self) -> None:
        if (self.worker_url is None) == (self.gateway_url is None):
            raise ValueError("worker: give a worker URL or a gateway URL, one of them")
        if self.gateway_url is not None and self.model is None:
            raise ValueError("model-name: driving through a gateway needs the served model's name")


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Every setting of a run; the defaults are the single-machine demo (``make run``)."""

    data_dir: Path = DEFAULT_DATA_DIR
    model_dir: Path | None = None
    """None: the tiny model in ``data_dir/tiny-model``, created there if missing."""
    reasoning_parser: str = AUTO
    """The worker's reasoning parser (``pipeline.worker.reasoning``)."""
    tokenizer_mode: str = AUTO
    """The worker's tokenizer mode (``pipeline.worker.tokenizer_mode``): ``auto`` or ``mistral``."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    """``bootstrap_servers=None`` starts the embedded broker in ``data_dir``."""
    broker_storage: StorageMode = "durable"
    dataplane_mode: RunDataPlaneMode = "embedded"
    ray_address: str | None = None
    rollouts: int = 8
    group_size: int = 4
    turns: int = 3
    concurrency: int = 4
    max_tokens: int = 48
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    """None: not sent, so the engine's defaults (the model's ``generation_config.json``) apply;
    whatever it samples with is recorded on each call (DESIGN §4.7)."""
    seed: int = 0
    seal_grace_s: float = 10.0
    max_open_s: float = 600.0
    fetch_wait_ms: int | None = DEFAULT_TUNING.fetch_wait_ms
    """How long the broker may hold the stages' fetches (``ConsumerTuning.fetch_wait_ms``;
    ``None``: the broker kind's): on the embedded broker, latency per hop against how long
    a partition it can still serve (DESIGN §3)."""
    finalize_timeout_s: float = 600.0
    lag_timeout_s: float = 60.0
    keep: bool = False
    agent: AgentKind = "driver"
    """``driver``: the built-in driver builds admissions; ``sdk``: a plain OpenAI-SDK agent
    plays through the gateway, which builds them."""
    stages: StageHosting = "processes"
    """``processes``: the ledger and finalizer as ``tokentrail stage`` child processes (a
    core each); ``inline``: both as tasks on this process's event loop."""
    run_id: str | None = None
    attach: Attach | None = None
    """``tokentrail drive``: play against services already running instead of starting them."""
    tasks: tuple[Task, ...] | None = None
    """Tasks to play (``--tasks FILE``), each ``group_size`` times; ``rollouts`` must be
    their number times the group size. None: ``rollouts // group_size`` generated ones."""
    reward: RewardKind = "answer"
    """How the generated tasks are scored (``RewardKind``): ``digits`` is the dense reward the
    learning curves use."""
    train_steps: int = 0
    """Closed loop: this many steps of ``rollouts`` rollouts, a GRPO step and a refit each."""
    learning_rate: float = 1e-2
    trainer: TrainerKind = "builtin"
    """Who takes the train steps: the built-in GRPO step, or TRL's ``GRPOTrainer``."""
    max_staleness: int | None = None
    """Train steps: generation runs ahead of the trainer (either) by at most this many weight
    versions (paced, ``stages.trainer.pacing``); samples further behind are dropped.
    None: each step's rollouts are played, then trained on (staleness 0)."""
    staleness_measure: StaleMeasure = "oldest"
    """Which version of a sample staleness is measured by: its oldest token's, its newest's,
    or its admission's (``StalenessPolicy``)."""
    trainer_delay_s: float = 0.0
    """A deliberately slow trainer: each built-in step sleeps this long first (benchmarks, tests)."""
    trainer_dtype: TrainerDtype = "float32"
    """The trainer's weights, either trainer's (``TRAINER_DTYPES``)."""
    shift_behaviour_temperature: float | None = None
    """Benchmark only (``pipeline.trainer.shift``): the trainer feed states every call's
    temperature as this, so the captured logprobs are of a wrong temperature to the trainer."""

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling options every model call sends: the temperature, and the filters given."""
        options: dict[str, Any] = {"temperature": self.temperature}
        for name in ("top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    def __post_init__(self) -> None:
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
        if self.trainer_dtype not in TRAINER_DTYPES:
            raise ValueError(f"trainer_dtype: must be one of {TRAINER_DTYPES}, got {self.trainer_dtype!r}")
        if self.attach is not None and (self.embedded_broker or self.train_steps or self.keep):
            raise ValueError(
                "attach: driving running services needs --bootstrap, and trains or keeps nothing"
            )
        if self.tasks is not None and (
            self.train_steps or len(self.tasks) * self.group_size != self.rollouts
        ):
            raise ValueError("tasks: play each task group-size times, once (no --train-steps)")
        if self.reward not in get_args(RewardKind):
            raise ValueError(f"reward: must be one of {get_args(RewardKind)}, got {self.reward!r}")
        if self.tasks is not None and self.reward != "answer":
            raise ValueError("reward: scores generated tasks; a --tasks file is scored by its answers")
        if self.trainer == "trl" and not self.train_steps:
            raise ValueError("trainer: trl trains only with --train-steps N")
        if self.trainer == "trl" and self.max_staleness is not None:
            raise ValueError(
                "max_staleness: pacing TRL is not offered yet (a paced TRL run lost a group's staged rows "
                "before the finalizer read them, DESIGN §11); --max-staleness paces the built-in trainer"
            )
        if self.train_steps < 0:
            raise ValueError(f"train_steps: must be >= 0, got {self.train_steps}")
        if self.train_steps and self.keep:
            raise ValueError("train_steps: a training run does not --keep serving")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.max_staleness is not None and not self.train_steps:
            raise ValueError("max_staleness: paces (and drops) the samples of --train-steps only")
        if self.staleness_measure not in get_args(StaleMeasure):
            raise ValueError(
                f"staleness_measure: must be one of {get_args(StaleMeasure)}, got {self.staleness_measure!r}"
            )
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
