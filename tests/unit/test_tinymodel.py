"""The offline tiny model: deterministic files, a lossless tokenizer, both chat templates,
and a Hugging Face forward that runs. The model is built once per module (a few seconds)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline import cli
from pipeline.models import tiny as tinymodel

HASHED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "Add 2 and 3."},
    {
        "role": "assistant",
        "content": "<think>\n2 plus 3.\n</think>\n\nLet me check.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
    },
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5.", "reasoning_content": "The tool said 5."},
    {"role": "user", "content": "And 4 + 4?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in HASHED_FILES}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def test_model_files_are_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = tinymodel.make_tiny_model(tmp_path / "again", seed=0)
    assert file_hashes(again) == file_hashes(model_dir)
    other = tinymodel.make_tiny_model(tmp_path / "other", seed=1)
    hashes, other_hashes = file_hashes(model_dir), file_hashes(other)
    assert other_hashes["model.safetensors"] != hashes["model.safetensors"]
    # The tokenizer does not depend on the weight seed: a seed-1 model is a valid refit.
    assert other_hashes["tokenizer.json"] == hashes["tokenizer.json"]


def test_make_is_idempotent_and_refuses_foreign_directories(model_dir: Path, tmp_path: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert tinymodel.make_tiny_model(model_dir, seed=0) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    with pytest.raises(FileExistsError):
        tinymodel.make_tiny_model(model_dir, seed=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        tinymodel.make_tiny_model(foreign)
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")], "staging dir left behind"


def test_config_matches_what_the_engine_needs(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert config["head_dim"] == config["hidden_size"] // config["num_attention_heads"] == 32
    manifest = tinymodel.read_manifest(model_dir)
    assert manifest is not None
    ids = manifest["token_ids"]
    assert config["vocab_size"] == manifest["model_vocab_size"] == 1024
    assert manifest["eos_token_ids"] == [ids[tinymodel.IM_END], ids[tinymodel.ENDOFTEXT]]
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == manifest["eos_token_ids"]


def test_tokenizer_round_trips_and_keeps_chat_tokens_whole(tokenizer: Any) -> None:
    assert type(tokenizer).__name__ == "TokenizersBackend"  # tokenizer.json as trained, not rebuilt
    assert tokenizer.eos_token == tinymodel.IM_END
    text = 'Héllo wörld 🚀\n\t12 * 34 = 408.  <tool_call>\n{"name": "add"}\n</tool_call> <think>x</think>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    for token in (*tinymodel.SPECIAL_TOKENS, *tinymodel.ADDED_TOKENS):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    # Reasoning and tool-call markers are ordinary tokens: they survive skip_special_tokens.
    marked = tokenizer.encode("<think>a</think><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(marked, skip_special_tokens=True) == "<think>a</think>"


def test_chat_template_renders_with_and_without_generation_prompt(tokenizer: Any) -> None:
    without = render(tokenizer, CONVERSATION, tools=TOOLS)
    with_prompt = render(tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert without.startswith("<|im_start|>system\nYou add numbers.\n\n# Tools")
    assert '"name": "add"' in without
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in without
    assert "<|im_start|>tool\n5<|im_end|>\n" in without
    assert "<think>\nThe tool said 5.\n</think>\n\nIt is 5." in without
    # One <|im_end|> per message: the count prefix splicing relies on.
    assert without.count(tinymodel.IM_END) == len(CONVERSATION)
    plain = render(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_reasoning_stripping_template_drops_only_earlier_reasoning(tokenizer: Any) -> None:
    template = tinymodel.reasoning_stripping_template()
    stripped = render(tokenizer, CONVERSATION, chat_template=template)
    assert "<think>" not in stripped
    assert "<|im_start|>assistant\nLet me check.\n<tool_call>" in stripped
    assert "<|im_start|>assistant\nIt is 5.<|im_end|>" in stripped
    assert stripped.count(tinymodel.IM_END) == render(tokenizer, CONVERSATION).count(tinymodel.IM_END)
    # Turns after the last user message (the current agentic turn) keep their reasoning.
    current = render(tokenizer, CONVERSATION[:5], chat_template=template)
    assert "<think>\n2 plus 3.\n</think>" in current
    assert "<think>\nThe tool said 5.\n</think>" in current


def test_strip_reasoning_model_saves_that_template(tmp_path: Path) -> None:
    model = tinymodel.make_tiny_model(tmp_path / "strip", template="strip_reasoning")
    saved = (model / "chat_template.jinja").read_text()
    assert saved.strip() == tinymodel.reasoning_stripping_template().strip()


def test_hf_forward_runs_in_fp32(model_dir: Path, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.dtype == torch.float32
    assert logits.shape == (1, len(ids), len(tokenizer))
    logprobs = torch.log_softmax(logits[0, -1], dim=-1)
    assert torch.isfinite(logprobs).all()
    # Not near-uniform, so greedy decoding does not hinge on ties.
    assert float(logprobs.max()) > -3.0


def test_cli_verb_reports_json(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["make-tiny-model", str(model_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["created"] is False
    assert report["spec"]["seed"] == 0
    assert report["token_ids"][tinymodel.IM_END] >= 0
    assert cli.main(["make-tiny-model", str(model_dir), "--seed", "7"]) == 1


def test_moe_model_routes_each_token_to_two_of_four_experts(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    moe_dir = tinymodel.make_tiny_model(tmp_path / "moe", seed=0, experts=4)
    config = json.loads((moe_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert tinymodel.read_manifest(moe_dir)["spec"]["experts"] == 4  # type: ignore[index]
    assert "experts" not in (tinymodel.read_manifest(model_dir) or {})["spec"]  # dense manifests unchanged
    model: Any = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model.model.layers[0].mlp.gate(torch.randn(5, config["hidden_size"]))
    if isinstance(logits, tuple):  # some versions return (logits, scores, indices)
        logits = logits[0]
    chosen = torch.topk(torch.softmax(logits, dim=-1), 2).indices
    assert chosen.shape == (5, 2) and len({tuple(row) for row in chosen.tolist()}) > 1
