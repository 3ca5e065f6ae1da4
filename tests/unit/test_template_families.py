"""The template families of the tiny model, and the prefix splice on their real renders.

No engine: each family's tokenizer renders a tool-using conversation, "generated" ids
stand in for the model's replies, and every continuation is spliced as the worker does
(``ChatRenderer.spliced``). The engine-backed matrix is ``tests/families``.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline import cli
from pipeline.models import tiny as tinymodel
from stages.capture.chat import ChatRenderer, template_family
from stages.capture.splice import SpliceError

FAMILIES = ("chatml", "qwen3", "llama3", "gemma", "deepseek_r1", "mistral")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
# A template that keeps only the last two messages: its render of the history does not
# contain the turns the parent's exact tokens close.
WINDOWED = (
    "{%- for message in messages[-2:] -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: tinymodel.make_tiny_model(root / name, template=name) for name in FAMILIES}


def renderer_of(model_dir: Path, **kw: Any) -> ChatRenderer:
    return ChatRenderer.from_pretrained(model_dir, family=template_family(model_dir), **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_tokens_and_stop_ids(models: dict[str, Path], name: str) -> None:
    model_dir = models[name]
    chosen = tinymodel.family(name)
    renderer = renderer_of(model_dir)
    tokenizer = renderer.tokenizer
    manifest = tinymodel.read_manifest(model_dir)
    assert manifest is not None and manifest["spec"]["template"] == name
    ids = manifest["token_ids"]
    for token in chosen.special_tokens:
        assert tokenizer.encode(token, add_special_tokens=False) == [ids[token]], token
    assert tokenizer.eos_token == chosen.eos and tokenizer.bos_token == chosen.bos
    generation = json.loads((model_dir / "generation_config.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    assert generation["eos_token_id"] == manifest["eos_token_ids"] == [ids[t] for t in chosen.stops]
    assert config["eos_token_id"] == ids[chosen.eos]
    assert config["vocab_size"] == manifest["model_vocab_size"] == 1024 + len(chosen.special_tokens)
    # The engine stops on every id the splice counts, and on nothing else.
    assert renderer.eos_token_ids == frozenset(manifest["eos_token_ids"])
    assert renderer.family == name
    # The trained vocabulary is the same for every family: only added tokens differ.
    assert tokenizer.encode("What is 2 + 3?", add_special_tokens=False) == renderer_of(
        models["chatml"]
    ).tokenizer.encode("What is 2 + 3?", add_special_tokens=False)


def test_llama3_turns_close_with_a_token_that_is_not_the_tokenizer_eos(models: dict[str, Path]) -> None:
    tokenizer = renderer_of(models["llama3"]).tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert tokenizer.eos_token == "<|end_of_text|>"


def test_gemma_has_no_system_role_and_qwen3_thinking_can_be_off(models: dict[str, Path]) -> None:
    gemma = renderer_of(models["gemma"]).tokenizer
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = gemma.apply_chat_template(system, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    qwen3 = renderer_of(models["qwen3"]).tokenizer
    user = [{"role": "user", "content": "hi"}]
    on = qwen3.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    off = qwen3.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"


def episode(renderer: ChatRenderer, stop: int | None) -> tuple[list[int], list[list[int]]]:
    """Five calls with a tool call and its result, each continuation spliced; the prompts sent.

    Each "generation" is a fixed text's ids, closed by ``stop`` (or cut short when None);
    the agent's copy of the reply carries reasoning the template may strip.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    exact: list[int] = []
    prompts: list[list[int]] = []
    for turn in range(5):
        full = renderer.render(messages, TOOLS)
        prompt = renderer.spliced(exact, messages, TOOLS, full) if exact else full
        assert prompt[: len(exact)] == exact
        prompts.append(prompt)
        gen = renderer.encode(f"<think>\nstep {turn}\n</think>\n\nthe sum is {turn}")
        exact = prompt + gen + ([stop] if stop is not None else [])
        if turn == 1:  # the agent ran a tool for the model
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"},
            ]
        else:
            reply = {"role": "assistant", "content": f"<think>\nstep {turn}\n</think>\n\nthe sum is {turn}"}
            messages += [reply, {"role": "user", "content": f"And {turn} more?"}]
    return exact, prompts


@pytest.mark.parametrize("ends_on_stop", [True, False], ids=["stopped", "cut-short"])
@pytest.mark.parametrize("name", FAMILIES)
def test_five_turn_episode_splices_under_every_family(
    models: dict[str, Path], name: str, ends_on_stop: bool
) -> None:
    renderer = renderer_of(models[name])
    stop = renderer.tokenizer.convert_tokens_to_ids(tinymodel.family(name).stops[0]) if ends_on_stop else None
    _, prompts = episode(renderer, stop)
    for earlier, later in itertools.pairwise(prompts):
        assert later[: len(earlier)] == earlier  # every prompt extends the one before
    bos = tinymodel.family(name).bos
    if bos is not None:
        assert prompts[-1].count(renderer.tokenizer.convert_tokens_to_ids(bos)) == 1


def test_an_agent_added_assistant_turn_keeps_the_boundary_at_the_parents(models: dict[str, Path]) -> None:
    renderer = renderer_of(models["chatml"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    exact = renderer.render(messages) + renderer.encode("five")  # cut short: no EOS
    messages += [
        {"role": "assistant", "content": "five"},
        {"role": "user", "content": "Use the tool."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},  # not the engine's
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    full = renderer.render(messages)
    spliced = renderer.spliced(exact, messages, None, full)
    tail = renderer.tokenizer.decode(spliced[len(exact) :])
    assert tail.startswith("<|im_end|>\n<|im_start|>user\nUse the tool.<|im_end|>\n<|im_start|>assistant\n")
    assert tail.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


def test_a_render_that_already_holds_the_exact_prefix_is_sent_without_rendering_the_history(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Append-only: the render starts with the exact prefix, closed on a stop id, so the
    splice renders nothing more (its cost does not grow with the conversation); a render
    whose history differs from the exact tokens (reasoning stripped, the reply sent back
    otherwise than produced) still goes through the history render."""
    renderer = renderer_of(models["chatml"])
    stop = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    exact = renderer.render(messages) + renderer.encode("five") + [stop]
    messages += [{"role": "assistant", "content": "five"}, {"role": "user", "content": "More?"}]
    full = renderer.render(messages)
    thinking = renderer.render(messages[:1]) + renderer.encode("<think>\nadd\n</think>\n\nfive") + [stop]
    renders: list[int] = []
    original = renderer._ids
    monkeypatch.setattr(renderer, "_ids", lambda *a, **k: renders.append(1) or original(*a, **k))
    assert renderer.spliced(exact, messages, None, full) == full and renders == []
    cut_short = exact[:-1]  # no stop id: the rule puts one in, so the history is rendered
    assert renderer.spliced(cut_short, messages, None, full) == full and len(renders) == 1
    spliced = renderer.spliced(thinking, messages, None, full)
    assert spliced[: len(thinking)] == thinking and spliced != full and len(renders) == 2


def test_a_template_that_drops_turns_cannot_be_spliced(models: dict[str, Path]) -> None:
    renderer = renderer_of(models["chatml"], chat_template=WINDOWED)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    exact = renderer.render(messages) + renderer.encode("five")
    messages += [{"role": "assistant", "content": "five"}, {"role": "user", "content": "More?"}]
    with pytest.raises(SpliceError, match="the template does not render the parent's turns") as caught:
        renderer.spliced(exact, messages, None, renderer.render(messages))
    assert caught.value.code.value == "prefix_splice_failed"


def test_an_unknown_template_is_a_usage_error_listing_the_families(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["make-tiny-model", "/nonexistent/tiny", "--template", "phi"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--template" in error and all(name in error for name in tinymodel.TEMPLATES)
    with pytest.raises(ValueError, match="unknown template 'phi'; expected one of chatml, "):
        tinymodel.make_tiny_model(Path("/nonexistent/tiny"), template="phi")  # type: ignore[arg-type]


def test_a_turn_closer_the_engine_does_not_stop_on_cannot_be_spliced(models: dict[str, Path]) -> None:
    """Gemma-style turns on a model that stops only on ``<eos>``: no turn boundary exists."""
    gemma = renderer_of(models["gemma"])
    only_eos = ChatRenderer(gemma.tokenizer, [gemma.tokenizer.eos_token_id], family="gemma")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    exact = only_eos.render(messages) + only_eos.encode("five")
    messages += [{"role": "assistant", "content": "five"}, {"role": "user", "content": "More?"}]
    with pytest.raises(SpliceError, match="no EOS"):
        only_eos.spliced(exact, messages, None, only_eos.render(messages))
