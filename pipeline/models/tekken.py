"""Mistral's Tekken vocabulary for the tiny model, served as Mistral models are: by mistral_common.

Mistral models (Mistral NeMo, Devstral, Magistral, Mistral Small) ship ``tekken.json`` and no
Jinja template: vLLM's ``mistral`` tokenizer mode encodes their conversations with
mistral_common, whose instruct tokenizer knows the model's turn format. The tiny model gets
the file mistral_common ships (Mistral NeMo's, copied at build time, never committed) and no
Hugging Face tokenizer: transformers would convert it without its BOS and EOS and without
any chat template, so a worker serving the directory must use mistral_common
(``pipeline.worker.tokenizer_mode``).

NeMo's file (v3: 131,072 ids, the first 1,000 special) is text only; the newer file
mistral_common ships adds an image encoder the tiny text model has no use for.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pipeline.models.families import Family
from pipeline.models.vocabularies import package_file

TEKKEN_VOCAB = "mistral_tekken"
"""``make-tiny-model --vocab`` name of this vocabulary."""
TEKKEN_FILE = "tekken.json"
"""Where vLLM's mistral tokenizer (and mistral_common) look for it in a model directory."""
TEKKEN_TEMPLATE = "mistral_common"
"""What the tiny model records as its template: mistral_common renders its conversations."""
_SOURCE = ("data", "tekken_240718.json")
SUMMARY = "Mistral NeMo's Tekken (131,072 ids, 1,000 special), conversations encoded by mistral_common"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
TEKKEN_FAMILY = Family(
    TEKKEN_TEMPLATE,
    SUMMARY,
    template="",  # no Jinja template: mistral_common's instruct tokenizer renders
    special_tokens=(),
    eos=EOS,
    stops=(EOS,),  # only assistant turns are closed, by </s>
    bos=BOS,
)


def tekken_source() -> Path:
    """The Tekken file inside the installed mistral_common, or a clear error."""
    return package_file("mistral_common", *_SOURCE, extra="vllm")


def tekkenizer(path: Path | None = None) -> Any:
    """mistral_common's own ``Tekkenizer`` on the file (default: the one the package ships)."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    return Tekkenizer.from_file(str(tekken_source() if path is None else path))


def save_tekken(out_dir: Path) -> tuple[dict[str, int], int]:
    """Copy the file into ``out_dir``; return where BOS, EOS and PAD are and the vocabulary size."""
    shutil.copyfile(tekken_source(), out_dir / TEKKEN_FILE)
    tokenizer = tekkenizer(out_dir / TEKKEN_FILE)
    token_ids = {BOS: int(tokenizer.bos_id), EOS: int(tokenizer.eos_id), PAD: int(tokenizer.pad_id)}
    for token, token_id in token_ids.items():
        if tokenizer.id_to_piece(token_id) != token:
            raise ValueError(f"vocab: {TEKKEN_FILE} has {tokenizer.id_to_piece(token_id)!r} at {token}'s id")
    return token_ids, int(tokenizer.n_words)


__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SUMMARY",
    "TEKKEN_FAMILY",
    "TEKKEN_FILE",
    "TEKKEN_TEMPLATE",
    "TEKKEN_VOCAB",
    "save_tekken",
    "tekken_source",
    "tekkenizer",
]
