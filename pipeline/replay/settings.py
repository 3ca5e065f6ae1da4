"""What one ``tokentrail replay`` rebuilds, from where, and how often, and which rollout
``tokentrail ledger show`` prints from the result: their settings, written once.

Each verb's flags and help come from its model (``pipeline.process.flags``); the Kafka
connection travels with its own flags (``pipeline.kafka.config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Self

from aiokafka import TopicPartition
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from pipeline.process.datadir import DEFAULT_DATA_DIR
from pipeline.process.flags import NOT_A_FLAG, Flag
from pipeline.replay.continued import DEFAULT_MARGIN_S


def _start_offset(value: str) -> tuple[TopicPartition, int]:
    try:
        where, offset = value.rsplit("=", 1)
        topic, partition = where.rsplit(":", 1)
        return TopicPartition(topic, int(partition)), int(offset)
    except ValueError:
        raise ValueError(f"{value!r} is not TOPIC:PARTITION=OFFSET") from None


def _checked_start_offset(value: str) -> str:
    _start_offset(value)
    return value


StartOffset = Annotated[str, AfterValidator(_checked_start_offset)]
"""``TOPIC:PARTITION=OFFSET`` (``--from``): where a partition's rebuild starts."""


class ReplaySettings(BaseModel):
    """Each field is a ``tokentrail replay`` flag; settings that do not go together are
    refused naming the flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    out: Path
    """SQLite file to write"""
    start_offsets: Annotated[list[StartOffset] | None, Flag("--from", metavar="TOPIC:PARTITION=OFFSET")] = (
        None
    )
    """start that partition at that offset instead of its beginning (repeatable)"""
    seal_grace_s: Annotated[float, Field(gt=0), Flag("--seal-grace")] = 10.0
    """seconds a seal waited live"""
    processes: Annotated[int, Field(ge=1)] = 1
    """rebuild the partitions in this many processes, each its share"""
    checkpoints: Annotated[Path | None, Flag(metavar="DIR")] = None
    """continue from the newest checkpoint in DIR (else the log's start) and cut a new one"""
    checkpoint_margin_s: Annotated[float, Field(ge=0), Flag("--checkpoint-margin", metavar="SECONDS")] = (
        DEFAULT_MARGIN_S
    )
    """the new checkpoint covers the log up to this long before the replay began"""
    every_s: Annotated[float | None, Field(ge=0), Flag("--every", metavar="SECONDS")] = None
    """with --checkpoints: rebuild again this long after each rebuild ends, until stopped"""
    check: bool = False
    """compare with the live ledger; exit 1 on a difference"""
    show_progress: Annotated[bool, NOT_A_FLAG] = True
    """a progress bar on stderr (not with --json)"""

    @property
    def start(self) -> dict[TopicPartition, int]:
        """Where each partition named by ``--from`` starts."""
        return dict(_start_offset(value) for value in self.start_offsets or ())

    @model_validator(mode="after")
    def _together(self) -> Self:
        if self.checkpoints is None:
            if self.every_s is not None:
                raise ValueError("every_s: keeps a checkpoint current, so it needs --checkpoints")
            return self
        if self.start_offsets:
            raise ValueError("start_offsets: a rebuild from checkpoints starts where the newest one ends")
        if self.processes != 1:
            raise ValueError("processes: a rebuild from checkpoints runs in one process")
        return self


class ShowSettings(BaseModel):
    """Each field is a ``tokentrail ledger show`` flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    rollout_id: Annotated[str, Flag(positional=True)]
    """the rollout to show"""
    db: Path = DEFAULT_DATA_DIR / "ledger.sqlite"
    """ledger SQLite file"""
