"""Where a verb keeps its state when no ``--data-dir`` is given: one default for every verb."""

from pathlib import Path

DEFAULT_DATA_DIR = Path(".tokentrail")
