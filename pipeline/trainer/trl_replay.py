"""TRL's ``GRPOTrainer`` with the logprobs of each call's own sampling, and its importance
correction against the captured ones.

TRL 1.16 computes every per-token logprob its loss uses in one method,
``GRPOTrainer._get_per_token_logps_and_entropies``: the logits at one configured
temperature, untruncated. A captured logprob is of the call's processed distribution (its
temperature, min-p, top-k, top-p; DESIGN §4.7), so that method is overridden here to replay
each token's call (``stages.trainer.replay``): TRL's ratio, its clipping and its gradient
are then of the policy that sampled.

TRL's importance correction against an inference engine's logprobs (its
``vllm_importance_sampling_*`` options, in ``_generate_and_score_completions`` and
``_compute_loss``) is switched on by ``use_vllm``, which would also make TRL start its own
vLLM. So the trainer is built with ``use_vllm`` off and the flag is set after
``__init__``: tokentrail's worker is the vLLM engine that sampled, ``rollout_func`` hands
over its logprobs, and TRL's own code computes the truncated or masked ratio
``exp(old - sampling)`` and weighs the loss with it. The only other thing ``use_vllm``
makes TRL do with a ``rollout_func`` is call ``vllm_generation.sync_weights()`` in
``_generate`` when its step moved; tokentrail refits the worker after each optimizer step
itself, so ``WorkerWeights.sync_weights`` only checks that the worker serves that step.

Relied on (pinned: ``trl==1.16.0``): ``_get_per_token_logps_and_entropies`` (its arguments
and its ``(logps, entropies, aux_loss)`` result), ``_generate`` (its tuple with
``extra_fields`` sixth), ``_generate_and_score_completions`` (its output dict, shuffled row
by row before the loss), ``_compute_loss(model, inputs)``, and the attributes
``use_vllm``, ``vllm_generation`` and ``_last_loaded_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from pipeline.trainer.trl_fields import (
    INPUT_PREFIX,
    OPTIONS,
    SAMPLE_KEY_FIELD,
    SAMPLING_FIELD,
    aligned,
    padded,
)
from stages.trainer.replay import replay


class WorkerWeights:
    """TRL's handle on the engine that generates: tokentrail's worker, refit by the bridge."""

    def __init__(self, serving: Callable[[], int], step: Callable[[], int]) -> None:
        """``serving``: the version the worker serves; ``step``: TRL's optimizer step."""
        self._serving, self._step = serving, step

    def sync_weights(self) -> None:
        """TRL calls it before asking for completions once its step moved: the bridge has
        refit the worker to that step already; anything else would train stale samples
        as fresh ones."""
        if self._serving() != self._step():
            raise RuntimeError(
                f"worker serves weight version {self._serving()}, TRL is at step {self._step()}: the refit did not happen"
            )


class ReplayingGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose logprobs replay each call's sampling (see the module's docstring)."""

    def __init__(self, *args: Any, serving: Callable[[], int], **kwargs: Any) -> None:
        """``serving``: the weight version the worker serves (checked at each new step)."""
        super().__init__(*args, **kwargs)
        self.use_vllm = True  # the importance correction's switch: the captured logprobs are vLLM's
        self.vllm_generation = WorkerWeights(serving, lambda: int(self.state.global_step))  # type: ignore[assignment]
        self._last_loaded_step = 0  # the worker serves the initial weights
        self._sampling: dict[str, torch.Tensor] | None = None
        """The options of the rows being scored: the batch just generated, or the loss's batch."""
        self._generated: dict[str, list[list[float]]] | None = None

    def _generate(self, prompts: list[Any]) -> tuple[Any, ...]:
        generated = list(super()._generate(prompts))
        completion_ids, env_mask, logprobs, extra = generated[1], generated[2], generated[4], generated[5]
        sampling = extra.pop(SAMPLING_FIELD, None)
        keys = extra.pop(SAMPLE_KEY_FIELD, None)
        if sampling is None or keys is None:
            raise ValueError(f"rollout_func: must return {SAMPLING_FIELD} and {SAMPLE_KEY_FIELD}")
        self._generated = aligned(completion_ids, logprobs, env_mask, sampling, keys)
        return tuple(generated)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._sampling = None
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        width = output["completion_ids"].size(1)
        assert self._generated is not None  # set by _generate, which the call above ran
        for name, values in padded(self._generated, width).items():
            output[INPUT_PREFIX + name] = values.to(output["completion_ids"].device)
        self._sampling = self._generated = None
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self._sampling = {name: inputs[INPUT_PREFIX + name] for name in OPTIONS}
        try:
            loss: torch.Tensor = super()._compute_loss(model, inputs)  # type: ignore[no-untyped-call]
        finally:
            self._sampling = None
        return loss

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each completion token's logprob under its call's processed distribution, the
        entropies of those distributions, and a mixture of experts' auxiliary loss."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(
                f"{', '.join(given)}: tokentrail's samples are text, nothing multimodal is replayed"
            )
        sampling = self._options(input_ids.size(0), logits_to_keep)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                outputs = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows], **extra)
            logits = outputs.logits[:, -logits_to_keep - 1 : -1]
            shape = logits.shape[:2]
            replayed = replay(
                logits.reshape(-1, logits.size(-1)),
                input_ids[rows, -logits_to_keep:].reshape(-1),
                **{name: values[rows].reshape(-1) for name, values in sampling.items()},
            )
            logps.append(replayed.logprobs.reshape(shape))
            entropies.append(replayed.entropy.reshape(shape))
            if compute_aux_loss:
                aux.append(outputs.aux_loss)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    def _options(self, rows: int, width: int) -> dict[str, torch.Tensor]:
        """The options of the rows being scored, checked against their shape."""
        sampling = self._sampling
        if sampling is None and self._generated is not None:
            sampling = self._sampling = padded(self._generated, width)
        if sampling is None:
            raise RuntimeError(
                "no sampling options for the rows being scored: rollout_func must hand them over"
            )
        for name, values in sampling.items():
            if tuple(values.shape) != (rows, width):
                raise ValueError(f"{name}: shape {tuple(values.shape)} != the completions' {(rows, width)}")
        return sampling


__all__ = ["ReplayingGRPOTrainer", "WorkerWeights"]
