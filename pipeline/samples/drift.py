"""Re-tokenization drift: the generated turns a decode → re-encode would not give back.

A trainer that keeps text and tokenizes it again trains on other tokens than the policy
sampled whenever the sampled ids are not the tokenizer's own encoding of their text (a
sampled "To" + "Many" re-encodes as "ToMany"; a Thai cluster split across tokens merges).
Capture avoids this by keeping the ids; this count says how often it mattered, per run
and per model, so the saving is a measured figure rather than a claim.

A generated turn is a maximal run of loss-masked (mask 1) tokens of a sample. It drifts
when ``encode(decode(turn)) != turn``, decoding with special tokens kept (a turn closes on
one, and the encoder matches it back). The rule needs only the tokenizer's own files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Drift:
    """How many generated turns there were, and how many a re-tokenization would change."""

    turns: int
    drifted: int

    def document(self) -> dict[str, int]:
        return {"generated_turns": self.turns, "drifted_turns": self.drifted}


def generated_turns(token_ids: Sequence[int], token_mask: Sequence[int]) -> list[list[int]]:
    """The maximal runs of mask-1 tokens, in order."""
    if len(token_ids) != len(token_mask):
        raise ValueError(f"token_mask: {len(token_mask)} entries for {len(token_ids)} token_ids")
    turns: list[list[int]] = []
    current: list[int] = []
    for token, masked in zip(token_ids, token_mask, strict=True):
        if masked:
            current.append(int(token))
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return turns


def survives(turn: Sequence[int], tokenizer: Any) -> bool:
    """Whether ``turn`` re-encodes to itself (``tokenizer``: a ``tokenizers.Tokenizer``)."""
    text = tokenizer.decode(list(turn), skip_special_tokens=False)
    return list(tokenizer.encode(text, add_special_tokens=False).ids) == list(turn)


def drift_of(samples: Iterable[Mapping[str, Any]], tokenizer: Any) -> Drift:
    """The drift over samples carrying ``token_ids`` and ``token_mask`` (archived records)."""
    turns = drifted = 0
    for sample in samples:
        for turn in generated_turns(sample["token_ids"], sample["token_mask"]):
            turns += 1
            drifted += not survives(turn, tokenizer)
    return Drift(turns, drifted)


def model_tokenizer(model_dir: Path) -> Any | None:
    """The model's own ``tokenizer.json``, or None where the model has none to read."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


__all__ = ["Drift", "drift_of", "generated_turns", "model_tokenizer", "survives"]
