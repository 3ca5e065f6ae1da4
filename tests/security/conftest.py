"""Options and the report of the escape suite.

``--escape-table PATH`` rewrites the escape table in PATH (between its ``escape-table``
markers) from the attacks this run tried; the table is printed at the end of the run
whatever the options.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from escapekit import EscapeReport
from readme_tables import rewrite_between_markers


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokentrail escape suite")
    group.addoption("--escape-table", type=Path, help="rewrite the escape table in this Markdown file")


_REPORT = EscapeReport()


@pytest.fixture(scope="session")
def escape_report() -> EscapeReport:
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _REPORT.answers:
        return
    table = _REPORT.markdown()
    terminalreporter.section("escape suite: attacks tried and refused")
    terminalreporter.write(table)
    target: Path | None = config.getoption("--escape-table")
    if target is not None:
        rewrite_between_markers(target, "escape-table", table)
