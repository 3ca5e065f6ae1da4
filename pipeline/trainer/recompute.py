"""A trainer's logprobs of a batch's tokens, replayed per call, and the batch's mismatch report.

Both trainers (the built-in GRPO step and the TRL bridge) and ``tokentrail mismatch``
recompute the same thing: a causal LM's forward over the batch, the logits at each
position before a generated token processed as that token's call sampled it
(``stages.trainer.replay``), and the report of ``stages.trainer.mismatch`` over the
generated tokens, with the counts of what could not be replayed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.trainer.batch import TrainBatch, audit_batch
from stages.trainer.mismatch import Bounds, Tokens, concat, report
from stages.trainer.replay import replay
from stages.trainer.settings import ReplayMode
from topics.records import TrainingSample


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


def per_sample(batch: TrainBatch, recomputed: Recomputed) -> dict[str, list[float]]:
    """The trainer's logprobs of each sample, at its own length, by sample key."""
    logprobs = recomputed.logprobs.detach()
    return {
        sample.key: logprobs[row, : len(sample.token_ids)].tolist()
        for row, sample in enumerate(batch.samples)
    }


def mismatch_tokens(batch: TrainBatch, recomputed: Recomputed, *, first_sample: int = 0) -> Tokens:
    """The batch's generated tokens, flat, for ``stages.trainer.mismatch`` (their samples
    numbered from ``first_sample``, for a report over several batches)."""
    if recomputed.logprobs.shape != batch.loss_mask.shape:
        raise ValueError(
            f"trainer logprobs: shape {tuple(recomputed.logprobs.shape)} != the batch's mask"
            f" {tuple(batch.loss_mask.shape)}"
        )
    where = batch.loss_mask > 0
    rows, positions = where.nonzero(as_tuple=True)
    return Tokens(
        behaviour=batch.old_logprobs[where],
        trainer=recomputed.logprobs.detach()[where],
        sample=rows + first_sample,
        position=positions,
        version=batch.token_versions[where],
        turn=batch.turn[where],
        straddled=batch.straddled[where],
        after_tool=batch.after_tool[where],
        log_kept=recomputed.log_kept[where],
        rank=recomputed.rank[where],
    )


def mismatch_report(
    batch: TrainBatch, recomputed: Recomputed, *, policy_version: int, bounds: Bounds | None = None
) -> dict[str, Any]:
    """The batch's mismatch report (``stages.trainer.mismatch``) and what it could not replay."""
    tokens = mismatch_tokens(batch, recomputed)
    result = report(tokens, batch.samples, policy_version=policy_version, bounds=bounds)
    return result | replay_counts([batch], tokens)


def replay_counts(batches: Sequence[TrainBatch], tokens: Tokens) -> dict[str, Any]:
    """What the replay could not apply, over ``batches``, and the mean kept mass."""
    return {
        "provenance_unknown_tokens": sum(batch.provenance_unknown_tokens for batch in batches),
        "not_replayed_tokens": sum(batch.not_replayed_tokens for batch in batches),
        "unreplayable_samples": sum(sample.unreplayable for batch in batches for sample in batch.samples),
        "mean_log_kept": float(tokens.log_kept.double().mean()) if len(tokens.log_kept) else None,
    }


def measure(
    model: Any, batch: TrainBatch, *, policy_version: int, bounds: Bounds | None = None
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The batch's mismatch report under ``model`` in eval mode, without gradients (a
    trainer that computes its own loss, such as TRL's), and its logprobs per sample."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            recomputed = recompute(model, batch)
    finally:
        model.train(training)
    report = mismatch_report(batch, recomputed, policy_version=policy_version, bounds=bounds)
    return report, per_sample(batch, recomputed)


def replaying(batch: TrainBatch, mode: ReplayMode) -> TrainBatch:
    """The batch with only part of each call's processing replayed, to show what skipping
    it costs: ``temperature`` drops the filters (what trainers that ignore truncation
    compute), ``none`` the temperature too; ``full`` is the batch as it is."""
    if mode == "full":
        return batch
    temperature = torch.ones_like(batch.temperature) if mode == "none" else batch.temperature
    return dataclasses.replace(
        batch,
        temperature=temperature,
        top_k=torch.zeros_like(batch.top_k),
        top_p=torch.ones_like(batch.top_p),
        min_p=torch.zeros_like(batch.min_p),
    )


def audit(
    model: Any,
    samples: Sequence[TrainingSample],
    *,
    policy_version: int,
    mode: ReplayMode = "full",
    batch_size: int = 8,
    bounds: Bounds | None = None,
) -> dict[str, Any]:
    """The mismatch report of ``samples`` under ``model``, in batches of ``batch_size``
    (``tokentrail mismatch``: a past run's export, or a changed trainer, audited offline)."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    batches: list[TrainBatch] = []
    parts: list[Tokens] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            batch = replaying(audit_batch(samples[start : start + batch_size]), mode)
            parts.append(mismatch_tokens(batch, recompute(model, batch), first_sample=start))
            batches.append(batch)
    tokens = concat(parts)
    result = report(tokens, samples, policy_version=policy_version, bounds=bounds)
    return {"samples": len(samples), "replay": mode} | result | replay_counts(batches, tokens)


__all__ = [
    "Recomputed",
    "audit",
    "measure",
    "mismatch_report",
    "mismatch_tokens",
    "per_sample",
    "recompute",
    "replay_counts",
    "replaying",
]
