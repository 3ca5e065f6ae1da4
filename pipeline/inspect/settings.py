"""What ``tokentrail inspect`` serves, and where: its settings, written once.

The verb's flags and help come from this model (``pipeline.process.flags``); the
credentials, a deployment's Kafka log and the log format travel with their own flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pipeline.process.flags import Flag


class InspectSettings(BaseModel):
    """Each field is a ``tokentrail inspect`` flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    data_dir: Annotated[Path, Flag(positional=True, metavar="DATA_DIR")]
    """a run's data directory; with --bootstrap, where the deployment archives samples"""
    host: str = "127.0.0.1"
    """listen address"""
    port: Annotated[int, Field(ge=0, le=65535)] = 8200
    """listen port"""
    model_dir: Path | None = None
    """tokenizer to decode tokens with (default: DATA_DIR/tiny-model)"""
