"""What one ``tokentrail mismatch`` audits, with which model: its settings, written once.

The verb's flags and help come from this model (``pipeline.process.flags``); it imports
no torch, so the command line loads fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pipeline.process.flags import Flag
from stages.trainer.settings import ReplayMode, TrainerDtype


class AuditSettings(BaseModel):
    """Each field is a ``tokentrail mismatch`` flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    samples: Annotated[Path, Flag(positional=True)]
    """a JSON-lines or Parquet export, or a run's samples.jsonl"""
    model_dir: Annotated[Path, Flag("--model", metavar="MODEL")]
    """the trainer's model directory"""
    dtype: TrainerDtype = "float32"
    replay: ReplayMode = "full"
    """replay each call's temperature and filters (full), its temperature only, or nothing"""
    policy_version: Annotated[int | None, Field(ge=0)] = None
    """the model's weight version, for the lag buckets (default: the newest version in the samples)"""
    worst: Annotated[int, Field(ge=0)] = 10
    """worst tokens to list"""
    batch_size: Annotated[int, Field(ge=1)] = 8
    """samples per forward"""
