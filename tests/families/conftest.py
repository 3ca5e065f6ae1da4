"""The template-family matrix: one vLLM CPU engine per family, and the README table.

``family_engine`` is module-scoped and parametrized by family, so pytest runs every
test of one family on one engine before starting the next (five engine starts in all).
``--family-table PATH`` rewrites the family table in PATH (between its ``family-table``
markers) from what this run did; the table is printed at the end of the run whatever
the options.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from familykit import FamilyEngine, FamilyEngines, FamilyReport
from readme_tables import rewrite_between_markers

FAMILIES = ("llama3", "gemma", "chatml", "qwen3", "deepseek_r1")
"""The formats no real model of ``tests/models`` plays on every route. Mistral's is played
there through mistral_common, as vLLM serves Mistral models, on every route and streamed;
the ``[INST]`` template written here for it is still checked without an engine
(``tests/unit/test_template_families.py``)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokentrail template families")
    group.addoption("--family-table", type=Path, help="rewrite the family table in this Markdown file")


@pytest.fixture(scope="module", params=FAMILIES)
def family_engine(request: pytest.FixtureRequest, family_engines: FamilyEngines) -> FamilyEngine:
    """The family's tiny model (seed 0) served by its own engine (the frameworks' last)."""
    return family_engines.engine(request.param)


_REPORT = FamilyReport()


@pytest.fixture(scope="session")
def family_report() -> FamilyReport:
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _REPORT.results and not _REPORT.notes:
        return
    table = _REPORT.markdown()
    terminalreporter.section("template families: route results")
    terminalreporter.write(table)
    target: Path | None = config.getoption("--family-table")
    if target is not None:
        rewrite_between_markers(target, "family-table", table)
