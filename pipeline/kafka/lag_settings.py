"""Whose lag ``tokentrail lag`` shows: its settings, written once.

The verb's flags and help come from this model (``pipeline.process.flags``); the Kafka
connection travels with its own flags (``pipeline.kafka.config``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict

from pipeline.process.flags import Flag


class LagSettings(BaseModel):
    """Each field is a ``tokentrail lag`` flag; None: every group, or every topic a group committed on."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    group: Annotated[list[str] | None, Flag(metavar="GROUP")] = None
    """consumer group (repeatable)"""
    topic: Annotated[list[str] | None, Flag(metavar="TOPIC")] = None
    """topic (repeatable)"""
