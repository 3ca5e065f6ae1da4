"""Which renderer turns a model's chat into tokens, decided before the engine starts.

A directory whose only chat format is mistral_common (``tekken.json``, no Hugging Face
tokenizer) is served in vLLM's mistral mode under ``auto``; a model the worker could not
render chat for (no template, no mistral_common file) and contradictory options are
refused at start, by the worker and by ``tokentrail run``, naming the option and why.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.cli import build_parser
from pipeline.models.tekken import TEKKEN_FILE, TEKKEN_VOCAB
from pipeline.models.tiny import make_tiny_model
from pipeline.worker.reasoning import tool_parser_for
from pipeline.worker.tokenizer_mode import HF, MISTRAL, resolve_tokenizer_mode


@pytest.fixture(scope="module")
def tekken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tekken", vocab=TEKKEN_VOCAB)


@pytest.fixture
def templateless(model_dir: Path, tmp_path: Path) -> Path:
    """The toy model with its chat template taken out."""
    copy = Path(shutil.copytree(model_dir, tmp_path / "templateless"))
    (copy / "chat_template.jinja").unlink()
    return copy


def test_auto_serves_a_tekken_only_directory_through_mistral_common(
    tekken_dir: Path, model_dir: Path
) -> None:
    assert resolve_tokenizer_mode(tekken_dir, "auto") == MISTRAL
    assert resolve_tokenizer_mode(tekken_dir, "mistral") == MISTRAL
    assert resolve_tokenizer_mode(model_dir, "auto") == HF
    assert (tool_parser_for("auto", "llama", MISTRAL), tool_parser_for("auto", "llama", HF)) == (
        "mistral",
        "hermes",
    )
    assert tool_parser_for("llama3_json", "llama", MISTRAL) == "llama3_json"
    assert tool_parser_for(None, "llama", HF) is None


def test_a_hugging_face_tokenizer_beside_tekken_keeps_its_template(
    tekken_dir: Path, model_dir: Path, tmp_path: Path
) -> None:
    """With both (and no Mistral consolidated weights) ``auto`` is vLLM's: the template, which
    must then exist; the refusal says how to choose mistral_common. A tokenizer transformers
    cannot load is named as such."""
    both = Path(shutil.copytree(tekken_dir, tmp_path / "both"))
    for name in ("tokenizer_config.json", "tokenizer.json"):  # the toy's, its template left out
        shutil.copyfile(model_dir / name, both / name)
    with pytest.raises(ValueError, match=r"no chat template.*--tokenizer-mode mistral"):
        resolve_tokenizer_mode(both, "auto")
    (both / "consolidated.safetensors").write_bytes(b"")
    assert resolve_tokenizer_mode(both, "auto") == MISTRAL
    (both / "consolidated.safetensors").unlink()
    (both / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model: .* has no tokenizer transformers can load"):
        resolve_tokenizer_mode(both, "auto")


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown_mode", r"tokenizer-mode: unknown 'sentencepiece'; expected one of auto, mistral"),
        ("mistral_without_file", r"tokenizer-mode: mistral needs mistral_common's tokenizer .*tekken\.json"),
        ("template_over_mistral", r"chat-template: mistral_common renders this model's conversations"),
        ("no_template", r"model: .* has no chat template and no mistral_common tokenizer.*--chat-template"),
    ],
)
def test_what_the_worker_cannot_capture_is_refused(
    case: str, expected: str, model_dir: Path, tekken_dir: Path, templateless: Path
) -> None:
    arguments = {
        "unknown_mode": (model_dir, "sentencepiece", None),
        "mistral_without_file": (model_dir, "mistral", None),
        "template_over_mistral": (tekken_dir, "auto", "{{ messages }}"),
        "no_template": (templateless, "auto", None),
    }[case]
    directory, mode, template = arguments
    with pytest.raises(ValueError, match=expected):
        resolve_tokenizer_mode(directory, mode, chat_template=template)


def test_the_worker_and_run_refuse_before_the_engine_starts(
    templateless: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = ["worker", "--bootstrap", "127.0.0.1:9092", "--model"]
    args = build_parser().parse_args([*worker, str(templateless)])
    assert args.run(args) == 2
    assert "has no chat template and no mistral_common tokenizer" in capsys.readouterr().err
    args = build_parser().parse_args([*worker, str(model_dir), "--tokenizer-mode", "mistral"])
    assert args.run(args) == 2
    assert "tokenizer-mode: mistral needs mistral_common's tokenizer" in capsys.readouterr().err
    args = build_parser().parse_args(["run", "--model", str(templateless), "--data-dir", str(templateless)])
    assert args.run(args) == 2
    assert "tokentrail run: model:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args([*worker, str(model_dir), "--tokenizer-mode", "slow"])
    assert (
        "--tokenizer-mode: invalid choice: 'slow' (choose from 'auto', 'mistral')" in capsys.readouterr().err
    )


def test_the_engine_is_told_the_resolved_mode(tekken_dir: Path) -> None:
    from pipeline.commands.worker import worker_config

    args = build_parser().parse_args(["worker", "--bootstrap", "127.0.0.1:9092", "--model", str(tekken_dir)])
    config = worker_config(args)
    assert config.engine_settings().engine_kwargs()["tokenizer_mode"] == MISTRAL
    assert config.tool_parser == "auto" and config.tokenizer_mode == "auto"
    assert (tekken_dir / TEKKEN_FILE).is_file()
