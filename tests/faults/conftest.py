"""Options and the report of the fault suite.

``--seeds N`` runs every seeded scenario under seeds 1..N (CI uses the default, 2);
``--soak-seconds S`` sets the soak's length; ``--faults-table PATH`` rewrites the
fault table in PATH (between its ``faults-table`` markers) from what this run did.

Each test records what it injected and what survived through the ``fault_report``
fixture; the table is printed at the end of the run whatever the options.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from readme_tables import rewrite_between_markers

DEFAULT_SEEDS = 2
DEFAULT_SOAK_SECONDS = 60.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokentrail faults")
    group.addoption("--seeds", type=int, default=DEFAULT_SEEDS, help="seeded fault runs: seeds 1..N")
    group.addoption("--soak-seconds", type=float, default=DEFAULT_SOAK_SECONDS, help="length of the soak run")
    group.addoption("--faults-table", type=Path, help="rewrite the fault table in this Markdown file")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fault_seed" in metafunc.fixturenames:
        seeds = metafunc.config.getoption("--seeds")
        if seeds < 1:
            raise pytest.UsageError(f"--seeds: must be >= 1, got {seeds}")
        metafunc.parametrize("fault_seed", range(1, seeds + 1), ids=lambda s: f"seed{s}")


@dataclass
class _Row:
    injected: int = 0
    survived: int = 0
    outcome: str = ""


@dataclass
class FaultReport:
    """What each test injected, by section (faults, bad input) and kind."""

    rows: dict[str, dict[str, _Row]] = field(default_factory=lambda: defaultdict(dict))

    def record(self, section: str, kind: str, *, injected: int, survived: int, outcome: str) -> None:
        """Add ``injected`` faults of ``kind``; ``survived`` of them met every invariant."""
        row = self.rows[section].setdefault(kind, _Row())
        row.injected += injected
        row.survived += survived
        if outcome and outcome not in row.outcome:
            row.outcome = f"{row.outcome}; {outcome}" if row.outcome else outcome

    def markdown(self) -> str:
        lines: list[str] = []
        for section in sorted(self.rows):
            lines += [
                f"**{section}**",
                "",
                "| kind | injected | survived | what happened |",
                "|---|---:|---:|---|",
            ]
            for kind, row in sorted(self.rows[section].items()):
                lines.append(f"| {kind} | {row.injected} | {row.survived} | {row.outcome} |")
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


_REPORT = FaultReport()


@pytest.fixture(scope="session")
def fault_report() -> FaultReport:
    return _REPORT


@pytest.fixture(scope="session")
def soak_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--soak-seconds"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _REPORT.rows:
        return
    seeds = config.getoption("--seeds")
    table = f"Seeds 1..{seeds}.\n\n{_REPORT.markdown()}"
    terminalreporter.section("faults survived and bad inputs tried")
    terminalreporter.write(table)
    target: Path | None = config.getoption("--faults-table")
    if target is not None:
        rewrite_between_markers(target, "faults-table", table)
