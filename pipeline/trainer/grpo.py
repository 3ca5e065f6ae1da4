"""One GRPO policy-gradient step on a Hugging Face causal LM, in plain torch.

This is the smallest honest trainer for the closed loop of ``tokentrail run
--train-steps``: it recomputes every generated token's logprob under the weights it
holds, reports how far the importance ratio ``exp(logp_trainer - logp_sampled)`` is from
1 before updating (about 0 for on-policy samples: the proof that the captured logprobs
are the ones the trainer recomputes), and takes one clipped policy-gradient step with
the batch's group-normalized advantages. Logprobs are of the distribution each token's
call sampled from, as the engine records them (``processed_logprobs``): the call's own
temperature, min-p, top-k and top-p replayed on the trainer's logits
(``pipeline.trainer.recompute``). Every step also reports the batch's training-inference
mismatch (``stages.trainer.mismatch``), measured before the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.trainer.recompute import mismatch_report, per_sample, recompute
from stages.trainer.batch import TrainBatch
from stages.trainer.settings import TrainerDtype

CLIP = 0.2


@dataclass(frozen=True, slots=True)
class StepReport:
    loss: float
    ratio_max_abs_dev: float
    """max |exp(logp_trainer - logp_sampled) - 1| over generated tokens, before the update."""
    tokens: int
    update_norm: float
    """L2 norm of the change the step made to the weights (0 when every advantage is 0)."""
    policy_shift: float
    """max |logp_after - logp_before| over the batch's generated tokens: how far the step
    moved the policy. The next step's ``ratio_max_abs_dev`` stays near 0 only if the
    worker sampled with the new weights, so a shift well above it proves the refit."""
    clip_fraction: float = 0.0
    """Generated tokens whose clipped term the loss took (``|w - 1| > CLIP`` against their
    advantage's sign): their gradient is 0, the built-in step's own correction of a ratio
    away from 1."""
    mismatch: dict[str, Any] | None = None
    """The batch's mismatch report before the update (``stages.trainer.mismatch``)."""
    trainer_logprobs: dict[str, list[float]] | None = None
    """Per sample key, the logprobs the report compared, before the update."""


class GrpoTrainer:
    """Holds the policy's weights (fp32, CPU), steps them, saves them for the worker to load."""

    def __init__(
        self, model_dir: Path, *, learning_rate: float = 1e-3, dtype: TrainerDtype = "float32"
    ) -> None:
        """``dtype``: the trainer's weights (``bfloat16`` shows a precision mismatch against an
        fp32 engine in the report)."""
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        self.model = model.eval()  # no dropout: the recomputed logprobs must be the sampler's
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=learning_rate)

    def token_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]``: each generated token's logprob under its call's processed distribution."""
        return recompute(self.model, batch).logprobs

    def step(self, batch: TrainBatch, *, policy_version: int = 0) -> StepReport:
        """``policy_version``: the version of the weights held, for the report's lag buckets."""
        mask = batch.loss_mask
        tokens = int(mask.sum())
        if tokens == 0:
            return StepReport(loss=0.0, ratio_max_abs_dev=0.0, tokens=0, update_norm=0.0, policy_shift=0.0)
        recomputed = recompute(self.model, batch)
        mismatch = mismatch_report(batch, recomputed, policy_version=policy_version)
        new = recomputed.logprobs
        ratio = torch.exp(new - batch.old_logprobs)
        deviation = float(((ratio.detach() - 1).abs() * mask).max())
        advantages = (batch.advantages * batch.sample_weights).unsqueeze(-1)
        clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
        surrogate, bounded = ratio * advantages, clipped * advantages
        loss = -(torch.minimum(surrogate, bounded) * mask).sum() / tokens
        clip_fraction = float(((bounded < surrogate).detach() & (mask > 0)).sum()) / tokens
        before = [p.detach().clone() for p in self.model.parameters()]
        self.optimizer.zero_grad()
        torch.autograd.backward([loss])
        self.optimizer.step()
        moved = sum(
            float((p.detach() - old).pow(2).sum())
            for p, old in zip(self.model.parameters(), before, strict=True)
        )
        with torch.no_grad():
            shift = float(((self.token_logprobs(batch) - new.detach()).abs() * mask).max())
        return StepReport(
            loss=float(loss.detach()),
            ratio_max_abs_dev=deviation,
            tokens=tokens,
            update_norm=moved**0.5,
            policy_shift=shift,
            clip_fraction=clip_fraction,
            mismatch=mismatch,
            trainer_logprobs=per_sample(batch, recomputed),
        )

    def save(self, out_dir: Path) -> Path:
        """The weights in checkpoint format (safetensors and config), for ``reload_weights``."""
        self.model.save_pretrained(str(out_dir))
        return out_dir
