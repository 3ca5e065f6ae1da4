"""``--reasoning-parser``: the family's parser by default, off, a named one, or a usage error."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.worker.reasoning import reasoning_parser_for


def test_auto_picks_the_parser_that_fits_the_family() -> None:
    assert reasoning_parser_for("auto", "qwen3") == "qwen3"
    assert reasoning_parser_for("auto", "deepseek_r1") == "deepseek_r1"
    assert reasoning_parser_for("auto", "chatml") is None  # a family that does not reason
    assert reasoning_parser_for("none", "qwen3") is None
    assert reasoning_parser_for("granite", "chatml") == "granite"  # any of vLLM's, by name


def test_an_unknown_parser_is_refused_listing_vllm_s() -> None:
    with pytest.raises(
        ValueError, match=r"reasoning-parser: unknown 'thinker'; auto, none or one of vLLM's: .*qwen3"
    ):
        reasoning_parser_for("thinker", "qwen3")


@pytest.mark.parametrize("verb", [["run"], ["worker", "--bootstrap", "127.0.0.1:1"]])
def test_the_verbs_refuse_it_before_starting_anything(
    verb: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = [*verb, "--model", str(model), "--reasoning-parser", "thinker"]
    assert main(argv) == 2
    assert "reasoning-parser: unknown 'thinker'" in capsys.readouterr().err
