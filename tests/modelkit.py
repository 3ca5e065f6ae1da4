"""What the model matrix (``tests/models``) found, cell by cell, for the README model table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from pipeline.models.tekken import TEKKEN_VOCAB
from pipeline.models.vocabularies import vocabulary


def describe(vocab: str) -> str:
    """A row's name: the vocabulary, the package it comes from, and what renders its chats."""
    if vocab == TEKKEN_VOCAB:
        return f"{vocab} (`mistral_common`, rendered by mistral_common)"
    known = vocabulary(vocab)
    if known.architecture == "gpt_oss":
        return f"{vocab} (`{known.package}`, rendered by openai_harmony)"
    return f"{vocab} (`{known.package}`, template `{known.template}`)"


@dataclass
class ModelReport:
    """(vocabulary, cell) -> outcome for the README table; an attempt not recorded failed."""

    cells: dict[tuple[str, str], str] = field(default_factory=dict)

    def attempt(self, vocab: str, cell: str) -> None:
        self.cells[(vocab, cell)] = "**failed**"

    def record(self, vocab: str, cell: str, outcome: str) -> None:
        self.cells[(vocab, cell)] = outcome

    def markdown(self) -> str:
        """One row per vocabulary, one column per cell (a cell that does not apply is "-")."""
        vocabs = list(dict.fromkeys(vocab for vocab, _ in self.cells))
        cells = list(dict.fromkeys(cell for _, cell in self.cells))
        lines = ["| model (package) | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
        for vocab in vocabs:
            name = describe(vocab)
            lines.append(f"| {name} | " + " | ".join(self.cells.get((vocab, c), "-") for c in cells) + " |")
        return "\n".join(lines) + "\n"


def played_cells(routes: Sequence[str], gateway: Sequence[tuple[str, bool]]) -> pytest.MarkDecorator:
    """The cells a model with a test of its own plays: every route at the worker, plain and
    streamed, and through the gateway the (route, streamed) pairs named."""
    cells = [("worker", route, stream) for route in routes for stream in (False, True)]
    cells += [("gateway", route, stream) for route, stream in gateway]
    return pytest.mark.parametrize(
        ("where", "route", "stream"),
        cells,
        ids=[f"{where}-{route}-{'stream' if stream else 'plain'}" for where, route, stream in cells],
    )
