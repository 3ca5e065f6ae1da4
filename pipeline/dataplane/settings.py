"""Where ``tokentrail dataplane`` serves and publishes its addresses: its settings, written once.

The verb's flags and help come from this model (``pipeline.process.flags``); what it
does not set comes from the ``TOKENTRAIL_DATAPLANE_*`` environment (``DataPlaneConfig.from_env``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipeline.dataplane.config import DEFAULT_HOST, DataPlaneConfig


class DataPlaneSettings(BaseModel):
    """Each field is a ``tokentrail dataplane`` flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    data_dir: Path | None = None
    """directory for dataplane.json (default: $TOKENTRAIL_DATA_DIR or .tokentrail)"""
    host: str = DEFAULT_HOST
    """loopback address to bind"""

    def config(self) -> DataPlaneConfig:
        """The embedded data plane these settings describe; ``ValueError`` for one it cannot be
        (a host that is no loopback address)."""
        overrides: dict[str, object] = {"mode": "embedded", "host": self.host}
        if self.data_dir is not None:
            overrides |= {"data_dir": self.data_dir, "addresses_file": None}
        return DataPlaneConfig.from_env(**overrides)
