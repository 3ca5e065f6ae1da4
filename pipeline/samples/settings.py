"""What ``tokentrail samples export`` writes, and where: its settings, written once.

The verb's flags and help come from this model (``pipeline.process.flags``); the archive's
are ``pipeline.stagehost.sample_archive.ArchiveSettings``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.process.datadir import DEFAULT_DATA_DIR
from pipeline.process.flags import Flag
from pipeline.samples.export import ExportFormat


class ExportSettings(BaseModel):
    """Which archived samples to write, in which format, where."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    data_dir: Path = DEFAULT_DATA_DIR
    """data directory"""
    format: ExportFormat = "jsonl"
    """output format"""
    out: Annotated[Path | None, Flag(metavar="FILE")] = None
    """output file (default: stdout; required for parquet and --json)"""
    run_id: Annotated[str | None, Flag("--run", metavar="RUN_ID")] = None
    """only the samples of this run"""
    as_json: Annotated[bool, Flag("--json")] = False
    """print one JSON summary document on stdout"""

    @model_validator(mode="after")
    def _somewhere_to_write(self) -> Self:
        if self.out is None and self.format == "parquet":
            raise ValueError("out: required with parquet output")
        if self.out is None and self.as_json:
            raise ValueError("out: required with --json (stdout carries the summary)")
        return self
