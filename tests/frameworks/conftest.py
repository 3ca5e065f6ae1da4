"""The agent-framework matrix: one vLLM CPU engine per reasoning family, and the README table.

``family_engine`` is module-scoped and parametrized by family (as in ``tests/families``),
so pytest plays every framework's episode on one engine before starting the next (two
engine starts in all). ``--framework-table PATH`` rewrites the framework table in PATH
(between its ``framework-table`` markers) from what this run did; the table is printed at
the end of the run whatever the options.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from familykit import FamilyEngine, FamilyEngines
from readme_tables import rewrite_between_markers

from pipeline.models.tiny import TemplateName

FAMILIES: tuple[TemplateName, ...] = ("qwen3", "deepseek_r1")

Results = dict[tuple[str, str], str]
"""(framework case, family) -> outcome, in the order the cases ran."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokentrail agent frameworks")
    group.addoption("--framework-table", type=Path, help="rewrite the framework table in this Markdown file")


@pytest.fixture(scope="module", params=FAMILIES)
def family_engine(request: pytest.FixtureRequest, family_engines: FamilyEngines) -> FamilyEngine:
    """The family's tiny model (seed 0) served by its own engine, shared by every case."""
    return family_engines.engine(request.param)


_RESULTS: Results = {}


@pytest.fixture(scope="session")
def framework_results() -> Results:
    return _RESULTS


def markdown(results: Results) -> str:
    """One row per framework case, one column per family (a case not run is "-")."""
    cases = list(dict.fromkeys(case for case, _ in results))
    families = [family for family in FAMILIES if any(f == family for _, f in results)]
    lines = ["| agent | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
    for case in cases:
        lines.append(f"| {case} | " + " | ".join(results.get((case, f), "-") for f in families) + " |")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _RESULTS:
        return
    table = markdown(_RESULTS)
    terminalreporter.section("agent frameworks: episode results")
    terminalreporter.write(table)
    target: Path | None = config.getoption("--framework-table")
    if target is not None:
        rewrite_between_markers(target, "framework-table", table)
