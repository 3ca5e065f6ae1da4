"""A tiny causal language model built offline, for tests, demos and benchmarks.

The pipeline needs a real engine (vLLM CPU) and a real tokenizer with a chat template to
exercise token-in generation, prefix splicing and logprob capture end to end, but CI has
no model hub. So the model is made here from nothing: a Llama-architecture network with
seeded random fp32 weights and a byte-level BPE tokenizer trained on a corpus generated
in code, with a ChatML chat template, or the template, special tokens and stop tokens of
another family (``families``: Llama-3, Gemma, DeepSeek-R1, Mistral, Qwen3 style), so the
prefix splice is exercised on each family's turn format; or, with ``vocab``, a real model's
vocabulary and its own template (``vocabularies``; Mistral's Tekken, ``tekken``), where
re-tokenization drifts as it does for users. Everything is deterministic for a given seed, so
two machines that build the same model get byte-identical files, and a Hugging Face
forward can serve as the oracle for the engine's logprobs.

Why these choices:
- Llama, not Qwen2: for ``model_type`` qwen2, transformers 5 ignores the saved tokenizer
  class and rebuilds the tokenizer as ``Qwen2Tokenizer`` (its own pre-tokenizer regex and
  NFC normalization), so the trained ``tokenizer.json`` would not be what runs. For
  llama, ``AutoTokenizer`` (and therefore vLLM) loads ``tokenizer.json`` as saved.
- hidden 128 = 4 query heads x 32: vLLM's CPU attention backend supports only some head
  sizes, 32 being the smallest; 2 key/value heads so grouped-query attention is used.
- fp32 weights, so engine logprobs can be compared with a reference forward to ~1e-6.
- gpt-oss's vocabulary comes with gpt-oss's own network (``GptOssForCausalLM``: routed
  experts, attention sinks, a 128-token window on even layers), because vLLM renders and
  parses the harmony format only for that ``model_type``; 2 heads of 64 over one
  key/value head keep hidden 128 (64 is a head size vLLM's CPU attention takes).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pipeline.models.families import FAMILIES, Family
from pipeline.models.tekken import (
    PAD,
    TEKKEN_FAMILY,
    TEKKEN_FILE,
    TEKKEN_TEMPLATE,
    TEKKEN_VOCAB,
    save_tekken,
    tekkenizer,
)

TemplateName = Literal["chatml", "strip_reasoning", "qwen3", "llama3", "gemma", "deepseek_r1", "mistral"]
TEMPLATES: tuple[TemplateName, ...] = get_args(TemplateName)

# Special tokens: never produced by ordinary text, skipped when decoding for display.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Ordinary added tokens: single ids, but kept in decoded text so that reasoning and tool
# calls survive a decode -> re-render round trip.
ADDED_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# Written last, so its presence means the directory is complete; it also records the
# parameters, so a directory built with other parameters is never silently reused.
MANIFEST_NAME = "tinymodel.json"
MANIFEST_FORMAT = 1
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    MANIFEST_NAME,
)
HF_TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
"""The tokenizer files of every vocabulary but Tekken, which has its own (``tekken``)."""

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class TinyModelSpec:
    """The parameters that fully determine a tiny model's files."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 8192
    template: str = "chatml"
    """A family of ``TEMPLATES``, or with ``vocab`` that model's own template (TRL's name)."""
    vocab: str = ""
    """"": the toy vocabulary trained here. Else a real one (``vocabularies``), whose size
    ``vocab_size`` then records."""
    experts: int = 0
    """0: a dense Llama. Otherwise a Qwen2-MoE with this many routed experts per layer
    (no shared expert), ``experts_per_token`` of them per token."""
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    architecture: str = "llama"
    """``llama`` (a Llama, or with ``experts`` a Qwen2-MoE) or ``gpt_oss`` (gpt-oss's own
    network: every layer routed over ``experts``, attention sinks, YaRN rotary)."""
    sliding_window: int = 0
    """gpt-oss only: the window of its even layers (0: none)."""


MOE_FIELDS = ("experts", "experts_per_token", "moe_intermediate_size")
"""Left out of a dense model's manifest, so dense models built before MoE existed still match."""
VOCAB_FIELD = "vocab"
"""Left out for the toy vocabulary, so models built before real vocabularies still match."""
GPT_OSS_FIELDS = ("architecture", "sliding_window")
"""Left out of the other architectures' manifests, so models built before gpt-oss still match."""
GPT_OSS = "gpt_oss"


@dataclass(frozen=True)
class TokenLayout:
    """What training the tokenizer produced: chat token ids and the real vocabulary size.

    The vocabulary can come out smaller than asked when the corpus runs out of merges
    (about 2,100 here); the model's embedding is sized to the real one.
    """

    token_ids: dict[str, int]
    vocab_size: int
    family: Family
    pad: str = ENDOFTEXT

    @property
    def eos_token_ids(self) -> list[int]:
        """The family's stop ids, turn closer first (what the template writes)."""
        return [self.token_ids[token] for token in self.family.stops]


# --------------------------------------------------------------------------- templates

# Every literal is emitted through an expression and every tag trims whitespace, so the
# rendered text contains exactly the newlines spelled out in the strings, nothing more.
_TEMPLATE = r"""
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}{%- if part.text is defined -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = text_of(messages[0].content) -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system_text = none -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if system_text is not none or tools -%}
    {{- '<|im_start|>system\n' + (system_text if system_text is not none else '@DEFAULT_SYSTEM@') -}}
    {%- if tools -%}
        {{- '\n\n# Tools\n\nTo call a tool, reply with <tool_call>\n{"name": <name>, "arguments": <object>}\n'
            + '</tool_call>\n\n<tools>' -}}
        {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
        {{- '\n</tools>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
@LAST_USER@
{%- for message in turns -%}
    {%- if message.role == 'assistant' -%}
        {%- set body = text_of(message.content) -%}
        {%- if message.reasoning_content is defined and message.reasoning_content -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif message.reasoning is defined and message.reasoning -%}
            {%- set reasoning = message.reasoning -%}
        {%- else -%}
            {%- set reasoning = '' -%}
        {%- endif -%}
@STRIP@
        {{- '<|im_start|>assistant\n' -}}
        {%- if reasoning -%}{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}{%- endif -%}
        {{- body -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if body or reasoning or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# Qwen3-style history rewriting: assistant turns before the latest user message lose
# their reasoning, whether it came as a reasoning field or as inline <think> text.
_LAST_USER_INDEX = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
"""
_STRIP_OLD_REASONING = r"""
        {%- if loop.index0 < ns.last_user -%}
            {%- set reasoning = '' -%}
            {%- if '</think>' in body -%}{%- set body = body.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}
        {%- endif -%}
"""


def _render_template(*, strip_reasoning: bool) -> str:
    text = _TEMPLATE.replace("@DEFAULT_SYSTEM@", DEFAULT_SYSTEM_PROMPT)
    text = text.replace("@LAST_USER@", _LAST_USER_INDEX.strip() if strip_reasoning else "")
    text = text.replace("@STRIP@", _STRIP_OLD_REASONING.strip() if strip_reasoning else "")
    return text.strip() + "\n"


def chatml_template() -> str:
    """ChatML with tools: every turn is re-rendered verbatim, reasoning included.

    Each message ends with exactly one ``<|im_end|>``, which is what prefix splicing counts.
    """
    return _render_template(strip_reasoning=False)


def reasoning_stripping_template() -> str:
    """ChatML that drops ``<think>`` blocks from assistant turns before the last user turn.

    Real reasoning models' templates do this, so the re-rendered history differs from
    the tokens the model actually produced; tests use it to prove the splice keeps the
    exact prefix anyway (the EOS count per turn is unchanged, only positions shift).
    """
    return _render_template(strip_reasoning=True)


def family(name: str) -> Family:
    """The template family ``name``: its template, extra special tokens and stop tokens."""
    if name == "chatml":
        return Family(
            name,
            "ChatML (Qwen2.5): <|im_end|> and a newline after every turn",
            chatml_template(),
            special_tokens=(),
            eos=IM_END,
            stops=(IM_END, ENDOFTEXT),
        )
    if name == "strip_reasoning":
        return Family(
            name,
            "ChatML that drops <think> from turns before the last user turn",
            reasoning_stripping_template(),
            special_tokens=(),
            eos=IM_END,
            stops=(IM_END, ENDOFTEXT),
        )
    for known in FAMILIES:
        if known.name == name:
            return known
    raise ValueError(f"unknown template {name!r}; expected one of {', '.join(TEMPLATES)}")


def chat_template(name: TemplateName) -> str:
    """The template text for ``name``."""
    return family(name).template


# ---------------------------------------------------------------------------- corpus

_SENTENCES = (
    "the model reads a question and answers it step by step with care .",
    "we add two numbers then check the sum before we reply to the user .",
    "a tool can look up the weather , search the web , or run a small program .",
    "tokens are captured exactly so that training sees what the policy sampled .",
    "each rollout has turns ; each turn is one call to the engine with a prompt .",
    "please think about the problem first , then write the final answer clearly .",
)
_WORDS = [word for sentence in _SENTENCES for word in sentence.split()]
_TOOLS = ("add", "multiply", "search", "get_weather", "run_python", "lookup")
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Austin", "Delhi", "Quito")


def build_corpus() -> list[str]:
    """Deterministic training text covering prose, arithmetic, JSON tool calls and chat.

    The tokenizer is trained on this, so merges exist for what tests and demos send
    (numbers, JSON punctuation, tool names); anything else still encodes byte by byte.
    It does not depend on the weight seed: models that differ only in seed share one
    tokenizer, so one can stand in as a refit checkpoint for another.
    """
    rng = random.Random(20240601)
    lines: list[str] = []
    for _ in range(400):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        lines.append(" ".join(words).capitalize())
    for _ in range(600):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {result}.")
    for _ in range(200):
        name = rng.choice(_TOOLS)
        args: dict[str, Any] = (
            {"city": rng.choice(_CITIES)}
            if name == "get_weather"
            else {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}
        )
        call = json.dumps({"name": name, "arguments": args})
        lines.append(f"<tool_call>\n{call}\n</tool_call>")
        lines.append(f"<tool_response>\n{json.dumps({'result': rng.randint(0, 9999)})}\n</tool_response>")
    for _ in range(100):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(
            f"{IM_START}user\nAdd {a} and {b}.{IM_END}\n{IM_START}assistant\n"
            f"<think>\nI need {a} + {b}.\n</think>\n\nThe answer is {a + b}.{IM_END}\n"
        )
    return lines


# ------------------------------------------------------------------------- tokenizer


def train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with the chat tokens as added tokens.

    Byte level means every string encodes (no unknown token) and decodes back exactly.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(build_corpus(), trainer=trainer)
    # The trainer put all of them in the vocabulary; mark which ones are special.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tokenizer


def _transformers() -> Any:
    """The transformers module, typed loosely: its API is only partly annotated."""
    return importlib.import_module("transformers")


def _save_tokenizer(out_dir: Path, spec: TinyModelSpec) -> TokenLayout:
    """Save the wrapped tokenizer; return where its chat tokens landed."""
    from tokenizers import AddedToken

    if spec.vocab == TEKKEN_VOCAB:
        token_ids, size = save_tekken(out_dir)
        return TokenLayout(token_ids=token_ids, vocab_size=size, family=TEKKEN_FAMILY, pad=PAD)
    if spec.vocab:
        return _save_real_tokenizer(out_dir, spec)
    hf = _transformers()
    chosen = family(spec.template)
    backend = train_tokenizer(spec.vocab_size)
    # After training, so the trained vocabulary (and every id below it) is the same for all.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in chosen.special_tokens])
    extra = {} if chosen.bos is None else {"bos_token": chosen.bos}
    wrapped = hf.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=chosen.eos,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
        chat_template=chosen.template,
        **extra,
    )
    wrapped.save_pretrained(str(out_dir))
    tokens = (*SPECIAL_TOKENS, *ADDED_TOKENS, *chosen.special_tokens)
    return TokenLayout(
        token_ids={token: int(backend.token_to_id(token)) for token in tokens},
        vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
        family=chosen,
    )


def _save_real_tokenizer(out_dir: Path, spec: TinyModelSpec) -> TokenLayout:
    """Save a real model's vocabulary with its own template; its chat tokens are its stops."""
    from pipeline.models.vocabularies import load_tokenizer, vocabulary

    real = vocabulary(spec.vocab)
    chosen = real.family()
    backend = load_tokenizer(real)
    extra = {} if chosen.bos is None else {"bos_token": chosen.bos}
    wrapped = _transformers().PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=chosen.eos,
        pad_token=real.pad,
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
        chat_template=chosen.template,
        **extra,
    )
    wrapped.save_pretrained(str(out_dir))
    tokens = {*chosen.stops, chosen.eos, real.pad, *([] if chosen.bos is None else [chosen.bos])}
    return TokenLayout(
        token_ids={token: int(backend.token_to_id(token)) for token in sorted(tokens)},
        vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
        family=chosen,
        pad=real.pad,
    )


# ----------------------------------------------------------------------------- model


def _init_weights(model: Any, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in sorted name order.

    Independent of the library's own initializers (which change between versions), so
    the same seed gives the same bytes. The output head is scaled so logits spread over
    a few nats: near-uniform distributions would make greedy decoding hinge on ties.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.numel() == 0:
                continue  # a disabled part (the MoE model's shared expert)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith("bias"):
                std = 0.02
            elif "embed_tokens" in name:
                std = 1.0
            elif name.startswith("lm_head"):
                std = 0.4
            else:
                std = param.shape[-1] ** -0.5
            sample = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(sample * std)


def _save_model(out_dir: Path, spec: TinyModelSpec, layout: TokenLayout) -> None:
    import torch

    hf = _transformers()
    config = (
        _gpt_oss_config(hf, spec, layout)
        if spec.architecture == GPT_OSS
        else _moe_config(hf, spec, layout)
        if spec.experts
        else hf.LlamaConfig(
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.hidden_size // spec.num_attention_heads,
            max_position_embeddings=spec.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **_token_fields(layout),
            architectures=["LlamaForCausalLM"],
        )
    )
    model_class = (
        hf.GptOssForCausalLM
        if spec.architecture == GPT_OSS
        else hf.Qwen2MoeForCausalLM
        if spec.experts
        else hf.LlamaForCausalLM
    )
    with torch.device("cpu"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        model = model_class(config).to(torch.float32)
    _init_weights(model, spec.seed)
    model.generation_config = hf.GenerationConfig(
        eos_token_id=layout.eos_token_ids,
        pad_token_id=layout.token_ids[layout.pad],
    )
    with _quiet_progress():
        model.save_pretrained(str(out_dir))
    if spec.experts:
        _drop_empty_tensors(out_dir / "model.safetensors")


def _token_fields(layout: TokenLayout) -> dict[str, Any]:
    """What every network's config takes from the tokenizer: its size and chat token ids, fp32."""
    return {
        "vocab_size": layout.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": None if layout.family.bos is None else layout.token_ids[layout.family.bos],
        "eos_token_id": layout.token_ids[layout.family.eos],
        "pad_token_id": layout.token_ids[layout.pad],
        "dtype": "float32",
    }


def _moe_config(hf: Any, spec: TinyModelSpec, layout: TokenLayout) -> Any:
    """Qwen2-MoE (served by vLLM and transformers alike), every layer sparse, no shared expert."""
    if not 1 <= spec.experts_per_token <= spec.experts:
        raise ValueError(f"experts_per_token: must be in 1..{spec.experts}, got {spec.experts_per_token}")
    return hf.Qwen2MoeConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=0,
        num_experts=spec.experts,
        num_experts_per_tok=spec.experts_per_token,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        **_token_fields(layout),
        architectures=["Qwen2MoeForCausalLM"],
    )


_YARN_ORIGINAL_POSITIONS = 4096
"""gpt-oss's pre-YaRN context; the factor stretches it to the spec's positions."""


def _gpt_oss_config(hf: Any, spec: TinyModelSpec, layout: TokenLayout) -> Any:
    """gpt-oss's network at toy size: every layer routed, sinks, the sliding window on even
    layers and YaRN rotary as the released models have them (vLLM's gpt-oss reads YaRN's
    parameters unconditionally)."""
    return hf.GptOssConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size,
        num_local_experts=spec.experts,
        num_experts_per_tok=spec.experts_per_token,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        sliding_window=spec.sliding_window or None,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": spec.max_position_embeddings / _YARN_ORIGINAL_POSITIONS,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": _YARN_ORIGINAL_POSITIONS,
        },
        **_token_fields(layout),
        architectures=["GptOssForCausalLM"],
    )


def _drop_empty_tensors(path: Path) -> None:
    """The disabled shared expert is saved as zero-size tensors, which vLLM refuses to load."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    kept = {name: tensor for name, tensor in tensors.items() if tensor.numel() > 0}
    if len(kept) != len(tensors):
        save_file(kept, str(path), metadata={"format": "pt"})


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence the library's progress bar: ``--json`` callers parse our output."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- entry


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest of a complete tiny model in ``model_dir``, else None."""
    if not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return None
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    spec = manifest.get("spec")
    vocab = spec.get(VOCAB_FIELD) if isinstance(spec, dict) else None
    tokenizer_files = (TEKKEN_FILE,) if vocab == TEKKEN_VOCAB else HF_TOKENIZER_FILES
    return manifest if all((model_dir / name).is_file() for name in tokenizer_files) else None


def _expected_manifest(spec: TinyModelSpec) -> dict[str, Any]:
    fields = asdict(spec)
    left_out = (
        (() if spec.experts else MOE_FIELDS)
        + (() if spec.vocab else (VOCAB_FIELD,))
        + (() if spec.architecture == GPT_OSS else GPT_OSS_FIELDS)
    )
    fields = {name: value for name, value in fields.items() if name not in left_out}
    return {"format": MANIFEST_FORMAT, "spec": fields}


def _existing(out_dir: Path, spec: TinyModelSpec) -> bool:
    """True if ``out_dir`` already holds this model; raise if it holds something else."""
    if not out_dir.exists():
        return False
    manifest = read_manifest(out_dir)
    if manifest is None:
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            return False
        raise FileExistsError(f"{out_dir} exists and is not a complete tiny model; refusing to overwrite")
    expected = _expected_manifest(spec)
    if {key: manifest.get(key) for key in expected} != expected:
        raise FileExistsError(
            f"{out_dir} holds a tiny model built with other parameters: {manifest.get('spec')}"
        )
    return True


def tiny_model_report(model_dir: Path, *, created: bool) -> dict[str, Any]:
    """Where the model is, whether this call built it, and what its manifest says it is."""
    manifest = read_manifest(model_dir) or {}
    return {
        "model_dir": str(model_dir.resolve()),
        "created": created,
        "spec": manifest.get("spec"),
        "token_ids": manifest.get("token_ids"),
        "eos_token_ids": manifest.get("eos_token_ids"),
    }


def make_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = TinyModelSpec.vocab_size,
    template: TemplateName = "chatml",
    experts: int = 0,
    vocab: str = "",
) -> Path:
    """Create the tiny model in ``out_dir`` (idempotent) and return the directory.

    ``experts`` > 0 builds a mixture-of-experts model (Qwen2-MoE, top-2 routing).
    ``vocab`` names a real model's vocabulary (``vocabularies.VOCAB_NAMES``), built with that
    model's own chat template instead of ``template`` and ``vocab_size``, or Mistral's Tekken
    (``tekken.TEKKEN_VOCAB``): ``tekken.json`` and no Hugging Face tokenizer, mistral_common
    rendering its conversations.

    ``vocab_size`` is the tokenizer's target; see ``TokenLayout`` for when it falls
    short. The manifest (``tinymodel.json``, see ``read_manifest``) records the chat
    token ids and ``eos_token_ids``. If ``out_dir`` already holds a complete model built
    with the same parameters this does nothing; if it holds anything else it raises ``FileExistsError``. The files are
    built in a sibling temporary directory and renamed into place, so concurrent callers
    and interrupted builds never leave a half-written model behind. Offline only.
    """
    spec = _spec(seed=seed, vocab_size=vocab_size, template=template, experts=experts, vocab=vocab)
    out_dir = Path(out_dir)
    if _existing(out_dir, spec):
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        layout = _save_tokenizer(staging, spec)
        _save_model(staging, spec, layout)
        manifest = _expected_manifest(spec) | {
            "token_ids": layout.token_ids,
            "eos_token_ids": layout.eos_token_ids,
            "model_vocab_size": layout.vocab_size,
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _relax_permissions(staging)
        _install(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not _existing(out_dir, spec):
        raise RuntimeError(f"tiny model in {out_dir} is incomplete after building it")
    return out_dir


def _spec(*, seed: int, vocab_size: int, template: str, experts: int, vocab: str) -> TinyModelSpec:
    """The spec of a build, its options checked; a real vocabulary brings its own template and size."""
    if vocab == TEKKEN_VOCAB:
        size = int(tekkenizer().n_words)
        return TinyModelSpec(
            seed=seed, vocab_size=size, template=TEKKEN_TEMPLATE, vocab=vocab, experts=experts
        )
    if vocab:
        from pipeline.models.vocabularies import load_tokenizer, vocabulary

        real = vocabulary(vocab)
        size = int(load_tokenizer(real).get_vocab_size(with_added_tokens=True))
        if real.architecture == GPT_OSS:
            return _gpt_oss_spec(
                seed=seed, vocab_size=size, template=real.template, vocab=vocab, experts=experts
            )
        return TinyModelSpec(seed=seed, vocab_size=size, template=real.template, vocab=vocab, experts=experts)
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; expected one of {', '.join(TEMPLATES)}")
    if vocab_size < 512:
        raise ValueError("vocab_size must be at least 512 (256 bytes, chat tokens and merges)")
    return TinyModelSpec(seed=seed, vocab_size=vocab_size, template=template, experts=experts)


def _gpt_oss_spec(*, seed: int, vocab_size: int, template: str, vocab: str, experts: int) -> TinyModelSpec:
    """gpt-oss at toy size: 2 query heads of 64 (a head size vLLM's CPU attention takes) over
    one key/value head, 4 experts of width 64 (gpt-oss is always routed), top-2, window 128."""
    return TinyModelSpec(
        seed=seed,
        vocab_size=vocab_size,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=0,
        template=template,
        vocab=vocab,
        experts=experts or 4,
        architecture=GPT_OSS,
        sliding_window=128,
    )


def _relax_permissions(directory: Path) -> None:
    """Give the build ordinary umask permissions (mkdtemp and some writers use 0700/0600)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _install(staging: Path, out_dir: Path) -> None:
    """Move the finished build into place; losing a race to an identical build is fine."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    try:
        staging.rename(out_dir)
    except OSError:
        if read_manifest(out_dir) is None:
            raise
