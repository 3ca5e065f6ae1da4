"""What the TRL bridge hands TRL beside the fields TRL reads: each completion's sampling
options per token, and its sample's key; checked and padded here, without TRL imported
(``pipeline.trainer.trl_replay`` reads them in TRL's trainer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

SAMPLING_FIELD = "tokentrail_sampling"
"""The extra field of ``rollout_func``'s output with each completion's per-token sampling:
``{"temperature": [...], "top_k": [...], "top_p": [...], "min_p": [...]}``, aligned with
its ``completion_ids`` (``pipeline.trainer.trl.rollout_fields``)."""
SAMPLE_KEY_FIELD = "tokentrail_sample_key"
"""The extra field naming each completion's sample, for errors."""
OPTIONS: dict[str, tuple[float, torch.dtype]] = {
    "temperature": (1.0, torch.float32),
    "top_k": (0, torch.int64),
    "top_p": (1.0, torch.float32),
    "min_p": (0.0, torch.float32),
}
"""Each replayed option, its neutral value (padding) and its dtype."""
INPUT_PREFIX = "tokentrail_"
"""Where the options travel in TRL's batch dict, so they are shuffled with their rows."""


def aligned(
    completion_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    env_mask: Sequence[Sequence[int]] | None,
    sampling: Sequence[dict[str, list[float]]],
    keys: Sequence[str],
) -> dict[str, list[list[float]]]:
    """The per-token options of each completion, once every list is as long as its
    completion (a sample whose lengths differ fails by its key: never trained misaligned)."""
    if not len(completion_ids) == len(logprobs) == len(sampling) == len(keys):
        raise ValueError(
            f"rollout_func: {len(completion_ids)} completions, {len(logprobs)} logprobs,"
            f" {len(sampling)} {SAMPLING_FIELD}, {len(keys)} {SAMPLE_KEY_FIELD}"
        )
    out: dict[str, list[list[float]]] = {name: [] for name in OPTIONS}
    masks = env_mask if env_mask is not None else [None] * len(keys)
    if len(masks) != len(keys):
        raise ValueError(f"rollout_func: {len(masks)} env_mask for {len(keys)} completions")
    for ids, lps, mask, options, key in zip(completion_ids, logprobs, masks, sampling, keys, strict=True):
        lengths = {"logprobs": len(lps)} | {name: len(options.get(name, ())) for name in OPTIONS}
        if mask is not None:
            lengths["env_mask"] = len(mask)
        wrong = {name: n for name, n in lengths.items() if n != len(ids)}
        if wrong:
            raise ValueError(f"sample {key}: {len(ids)} completion tokens, but {wrong}")
        for name in OPTIONS:
            out[name].append(options[name])
    return out


def padded(options: dict[str, list[list[float]]], width: int) -> dict[str, torch.Tensor]:
    """``[B, width]`` tensors, each row padded on the right with the option's neutral value."""
    out = {}
    for name, (neutral, dtype) in OPTIONS.items():
        rows = options[name]
        values = torch.full((len(rows), width), neutral, dtype=dtype)
        for row, per_token in enumerate(rows):
            values[row, : len(per_token)] = torch.tensor(per_token, dtype=dtype)
        out[name] = values
    return out


__all__ = ["INPUT_PREFIX", "OPTIONS", "SAMPLE_KEY_FIELD", "SAMPLING_FIELD", "aligned", "padded"]
