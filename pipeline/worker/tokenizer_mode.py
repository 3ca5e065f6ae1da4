"""How a model's chat requests become tokens: its chat template, or mistral_common.

vLLM renders chat with the tokenizer's Jinja template (``hf``) or, in its ``mistral`` mode,
with mistral_common's instruct tokenizer, which knows Mistral models' turn format from the
model's ``tekken.json`` (or ``tokenizer.model.v*``). Capture re-renders the history with the
same renderer (DESIGN §5), so the worker decides the mode before the engine starts and
hands vLLM the decision rather than letting each guess.

``auto`` takes mistral_common where it is the model's only chat format: a mistral_common
tokenizer file and no Hugging Face tokenizer (transformers would convert the Tekken file
without BOS, EOS or template), or, as vLLM's own ``auto`` does, a mistral_common file beside
``consolidated*.safetensors`` (Mistral's own releases). Everything else is ``hf``, which
needs a chat template: the tokenizer's or ``--chat-template``. A model with neither is
refused here, at start, instead of failing every chat request later.

Light on purpose: the CLI resolves the mode without loading vLLM.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pipeline.models.tiny import HF_TOKENIZER_FILES

AUTO = "auto"
MISTRAL = "mistral"
HF = "hf"
TOKENIZER_MODES: tuple[str, ...] = (AUTO, MISTRAL)
"""What ``--tokenizer-mode`` accepts."""
MISTRAL_TOKENIZER_PATTERNS = ("tekken.json", "tokenizer.model.v*")
"""The files vLLM's mistral mode loads through mistral_common."""
MISTRAL_WEIGHTS_PATTERN = "consolidated*.safetensors"


def resolve_tokenizer_mode(model_dir: Path, choice: str, *, chat_template: str | None = None) -> str:
    """``mistral`` or ``hf`` for serving ``model_dir``; a ``ValueError`` naming the option and
    the reason when the worker could not capture the model's chat requests that way."""
    if choice not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer-mode: unknown {choice!r}; expected one of {', '.join(TOKENIZER_MODES)}")
    mistral_file = _any(model_dir, MISTRAL_TOKENIZER_PATTERNS)
    if choice == MISTRAL and not mistral_file:
        raise ValueError(
            f"tokenizer-mode: mistral needs mistral_common's tokenizer in {model_dir} "
            f"({' or '.join(MISTRAL_TOKENIZER_PATTERNS)}); there is none"
        )
    if choice == MISTRAL or (mistral_file and _mistral_only(model_dir)):
        if chat_template is not None:
            raise ValueError(
                "chat-template: mistral_common renders this model's conversations (tokenizer mode mistral); "
                "a Jinja template would not be what the engine serves"
            )
        return MISTRAL
    if chat_template is None and not _has_chat_template(model_dir):
        raise ValueError(
            f"model: {model_dir} has no chat template and no mistral_common tokenizer, so the worker cannot "
            "render chat requests nor capture them; pass --chat-template FILE"
            + (", or --tokenizer-mode mistral for a Mistral model" if mistral_file else "")
        )
    return HF


def _mistral_only(model_dir: Path) -> bool:
    """mistral_common is the model's chat format: no HF tokenizer, or Mistral's own weights."""
    no_hf = not any((model_dir / name).is_file() for name in HF_TOKENIZER_FILES)
    return no_hf or _any(model_dir, (MISTRAL_WEIGHTS_PATTERN,))


def _any(model_dir: Path, patterns: tuple[str, ...]) -> bool:
    return any(path.is_file() for pattern in patterns for path in model_dir.glob(pattern))


def _has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer transformers loads from ``model_dir`` carries a chat template."""
    try:
        tokenizer = importlib.import_module("transformers").AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers fails a bad file in many ways; all are a bad model dir
        raise ValueError(f"model: {model_dir} has no tokenizer transformers can load: {exc}") from exc
    return bool(getattr(tokenizer, "chat_template", None))


__all__ = [
    "AUTO",
    "HF",
    "MISTRAL",
    "TOKENIZER_MODES",
    "resolve_tokenizer_mode",
]
