"""What one ``tokentrail broker`` serves: its settings, written once.

The verb's flags and help come from this model (``pipeline.process.flags``); the topic
layout, the retention and the log format travel with their own flags
(``pipeline.kafka.config``, ``pipeline.kafka.retention``, ``pipeline.process.jsonlog``).
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, model_validator

from pipeline.kafka.embedded.broker import StorageMode
from pipeline.kafka.embedded.expiry import RETENTION_CHECK_S
from pipeline.kafka.retention import DEFAULT_RETENTION, TopicRetention
from pipeline.process.flags import NOT_A_FLAG, Flag
from stages.ledger.stage import LedgerConfig


class BrokerSettings(BaseModel):
    """Each field is a ``tokentrail broker`` flag, apart from the retention its own flag gives."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """listen address"""
    port: Annotated[int | None, Field(ge=0, le=65535)] = None
    """listen port (default: a free port)"""
    storage: StorageMode | None = None
    """storage engine (default: durable with --data-dir, else memory)"""
    data_dir: str | None = None
    """data directory (required for durable storage; holds logs)"""
    create_topics: bool = False
    """create the tokentrail topics once the broker is up"""
    max_open_s: Annotated[float, Field(gt=0), Flag("--max-open")] = Field(
        default=LedgerConfig().max_open_s,
        description=(
            "with --create-topics: the --max-open of the ledger these topics serve; no topic may keep its "
            f"records for less than that plus 1h (default: {LedgerConfig().max_open_s}, tokentrail stage's)"
        ),
    )
    retention_check_s: Annotated[float, Field(gt=0)] = RETENTION_CHECK_S
    """with durable storage: seconds between deletions of what the topics' retention has passed"""
    retention: Annotated[InstanceOf[TopicRetention] | None, NOT_A_FLAG] = None
    """``--retention``, when given (else the defaults): the retention of the topics it creates."""

    @model_validator(mode="after")
    def _together(self) -> Self:
        if self.storage == "durable" and self.data_dir is None:
            raise ValueError("data_dir: durable storage needs a data directory")
        if self.retention is not None and not self.create_topics:
            raise ValueError("retention: sets the topics --create-topics creates; add it")
        if self.create_topics:
            self.topic_retention.check(self.max_open_s)
        return self

    @property
    def topic_retention(self) -> TopicRetention:
        return self.retention or DEFAULT_RETENTION

    @property
    def resolved_storage(self) -> StorageMode:
        """Durable when asked, or when a data directory is given without a storage; else memory."""
        return (
            "durable" if self.storage == "durable" or (self.storage is None and self.data_dir) else "memory"
        )
