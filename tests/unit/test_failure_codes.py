"""The failure-code table: every code has a meaning, and DESIGN §6 lists exactly the codes."""

from __future__ import annotations

import re
from pathlib import Path

from topics.failures import ALL_FAILURE_CODES, MEANINGS

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"


def test_every_code_has_a_one_line_meaning() -> None:
    assert set(MEANINGS) == ALL_FAILURE_CODES
    assert all(meaning and "\n" not in meaning for meaning in MEANINGS.values())


def test_design_lists_exactly_the_codes() -> None:
    section = DESIGN.read_text().split("## 6. Failure codes", 1)[1].split("\n## 7.", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert named >= ALL_FAILURE_CODES, ALL_FAILURE_CODES - named
