"""The model matrix: one vLLM CPU engine per real vocabulary, and the README model table.

``vocab_engine`` is module-scoped and parametrized by vocabulary, so pytest plays every
cell of one vocabulary on one engine before starting the next. ``--model-table PATH``
rewrites the model table in PATH (between its ``model-table`` markers) from what this run
did; the table is printed at the end of the run whatever the options.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from enginekit import EngineHost
from familykit import FamilyEngine
from modelkit import ModelReport
from readme_tables import rewrite_between_markers

from pipeline.models.tiny import make_tiny_model
from pipeline.models.vocabularies import VOCABULARIES
from stages.capture.vllm.engine import EngineSettings


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokentrail real models")
    group.addoption("--model-table", type=Path, help="rewrite the model table in this Markdown file")


TEMPLATED = tuple(vocab.name for vocab in VOCABULARIES if vocab.architecture == "llama")
"""The vocabularies whose chats their Jinja template renders; gpt-oss (harmony, rendered by
vLLM itself) and Mistral's Tekken (mistral_common) have tests of their own, which add their
rows to the same table."""


@pytest.fixture(scope="module", params=TEMPLATED)
def vocab_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FamilyEngine]:
    """A tiny model (seed 0) on the real vocabulary, with its own template, on its own engine."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / request.param, vocab=request.param)
    host = EngineHost(EngineSettings(model=str(model_dir)))
    try:
        yield FamilyEngine(request.param, model_dir, host)
    finally:
        host.close()


_REPORT = ModelReport()


@pytest.fixture(scope="session")
def model_report() -> ModelReport:
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _REPORT.cells:
        return
    table = _REPORT.markdown()
    terminalreporter.section("real models: matrix results")
    terminalreporter.write(table)
    target: Path | None = config.getoption("--model-table")
    if target is not None:
        rewrite_between_markers(target, "model-table", table)
