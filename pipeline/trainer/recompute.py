"""A trainer's logprobs of a batch's tokens, replayed per call, and the batch's mismatch report.

Both trainers (the built-in GRPO step and the TRL bridge) and ``tokentrail mismatch``
recompute the same thing: a causal LM's forward over the batch, the logits at each
position before a generated token processed as that token's call sampled it
(``stages.trainer.replay``), and the report of ``stages.trainer.mismatch`` over the
generated tokens, with the counts of what could not be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stages.trainer.batch import TrainBatch
from stages.trainer.mismatch import Bounds, Tokens, report
from stages.trainer.replay import replay


@dataclass(frozen=True, slots=True)
class Recomputed:
    """``[B, T]`` tensors aligned with the batch (0 where the loss mask is 0)."""

    logprobs: torch.Tensor
    """The trainer's logprob of each generated token (differentiable)."""
    log_kept: torch.Tensor
    rank: torch.Tensor


def recompute(model: Any, batch: TrainBatch) -> Recomputed:
    """The forward pass and the replay: ``logprobs[b, i]`` is of ``input_ids[b, i]`` given
    the tokens before it, under the distribution its call sampled from."""
    shape = batch.input_ids.shape
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    generated = batch.loss_mask[:, 1:] > 0
    replayed = replay(
        logits[:, :-1][generated],
        batch.input_ids[:, 1:][generated],
        temperature=batch.temperature[:, 1:][generated],
        top_k=batch.top_k[:, 1:][generated],
        top_p=batch.top_p[:, 1:][generated],
        min_p=batch.min_p[:, 1:][generated],
    )
    where = torch.nn.functional.pad(generated, (1, 0))

    def placed(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).masked_scatter(where, values.to(dtype))

    return Recomputed(
        logprobs=placed(replayed.logprobs, torch.float32),
        log_kept=placed(replayed.log_kept, torch.float32),
        rank=placed(replayed.rank, torch.int64),
    )


def mismatch_report(
    batch: TrainBatch, recomputed: Recomputed, *, policy_version: int, bounds: Bounds | None = None
) -> dict[str, Any]:
    """The batch's mismatch report (``stages.trainer.mismatch``) and what it could not replay."""
    if recomputed.logprobs.shape != batch.loss_mask.shape:
        raise ValueError(
            f"trainer logprobs: shape {tuple(recomputed.logprobs.shape)} != the batch's mask"
            f" {tuple(batch.loss_mask.shape)}"
        )
    where = batch.loss_mask > 0
    rows, positions = where.nonzero(as_tuple=True)
    tokens = Tokens(
        behaviour=batch.old_logprobs[where],
        trainer=recomputed.logprobs.detach()[where],
        sample=rows,
        position=positions,
        version=batch.token_versions[where],
        turn=batch.turn[where],
        straddled=batch.straddled[where],
        after_tool=batch.after_tool[where],
        log_kept=recomputed.log_kept[where],
        rank=recomputed.rank[where],
    )
    result = report(tokens, batch.samples, policy_version=policy_version, bounds=bounds)
    result["provenance_unknown_tokens"] = batch.provenance_unknown_tokens
    result["not_replayed_tokens"] = batch.not_replayed_tokens
    result["unreplayable_samples"] = sum(sample.unreplayable for sample in batch.samples)
    result["mean_log_kept"] = float(tokens.log_kept.double().mean()) if len(tokens.log_kept) else None
    return result


def measure(
    model: Any, batch: TrainBatch, *, policy_version: int, bounds: Bounds | None = None
) -> dict[str, Any]:
    """The batch's mismatch report under ``model`` in eval mode, without gradients (a
    trainer that computes its own loss, such as TRL's, or an audit)."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            recomputed = recompute(model, batch)
    finally:
        model.train(training)
    return mismatch_report(batch, recomputed, policy_version=policy_version, bounds=bounds)


__all__ = ["Recomputed", "measure", "mismatch_report", "recompute"]
