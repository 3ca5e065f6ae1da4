"""Tables that a suite writes into README.md between its own markers, from what it ran."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def rewrite_between_markers(path: Path, name: str, table: str) -> None:
    """Replace what lies between ``<!-- {name}:begin -->`` and ``<!-- {name}:end -->``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise pytest.UsageError(f"--{name}: {path} has no {begin} ... {end} markers")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{table}{end}", text))
