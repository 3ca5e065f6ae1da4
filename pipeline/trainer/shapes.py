"""Verified samples in the shapes other trainers take, as plain dicts of lists.

A sample is one token sequence over the calls of a chain: the first call's prompt, then
each call's generated tokens (mask 1) and the tool or user tokens carried into the next
call (mask 0). Trainers that take external rollouts split it the same way: the prompt
is what comes before the first generated token, the response (or completion) is the rest,
with a mask that is 1 on generated tokens only and the sampled logprobs aligned with it.
No trainer package is imported: these are the field names their public interfaces read.

- verl's agent loop (``AgentLoopOutput``): ``prompt_ids``, ``response_ids``,
  ``response_mask``, ``response_logprobs``, ``reward_score``, ``num_turns``,
  ``extra_fields``; one dict per sample.
- SkyRL's generator (``GeneratorOutput``): ``prompt_token_ids``, ``response_ids``,
  ``rewards``, ``loss_masks``, ``rollout_logprobs``, ``stop_reasons``,
  ``rollout_metrics``; one dict of per-sample lists for a batch.

Both carry each call's sampling provenance (DESIGN §4.7) as ``response_sampling``: per
sample, one entry per call with where its generated tokens start in the response, how
many there are, and its non-neutral sampling options, so a trainer can recompute the
distribution the logprobs are of (in verl's ``extra_fields``; in SkyRL's output beside
the fields it reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from topics.records import TrainingSample


@dataclass(frozen=True, slots=True)
class Split:
    """A sample cut where its first generated token starts."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    response_versions: list[int]
    response_sampling: list[dict[str, Any]]
    """Per call: ``response_start``, ``gen_len`` and ``sampling`` (its non-neutral options)."""


def split(sample: TrainingSample) -> Split:
    """Prompt = the first call's prompt; response = everything after it, tool tokens masked 0."""
    cut = sample.spans[0].start + sample.spans[0].carry_len
    return Split(
        prompt_ids=list(sample.token_ids[:cut]),
        response_ids=list(sample.token_ids[cut:]),
        response_mask=[int(m) for m in sample.token_mask[cut:]],
        response_logprobs=list(sample.logprobs[cut:]),
        response_versions=list(sample.weight_versions[cut:]),
        response_sampling=[
            {
                "response_start": span.start + span.carry_len - cut,
                "gen_len": span.gen_len,
                "sampling": span.sampling.extras() if span.sampling is not None else {},
            }
            for span in sample.spans
        ],
    )


def verl_agent_loop_output(sample: TrainingSample) -> dict[str, Any]:
    """One sample as verl's ``AgentLoopOutput`` fields. ``num_turns`` counts, per call, the
    turn it answered (user or tool) and its own reply."""
    part = split(sample)
    return {
        "prompt_ids": part.prompt_ids,
        "response_ids": part.response_ids,
        "response_mask": part.response_mask,
        "response_logprobs": part.response_logprobs,
        "reward_score": sample.reward,
        "num_turns": 2 * len(sample.spans),
        "extra_fields": {
            "rollout_id": sample.rollout_id,
            "group_id": sample.group_id,
            "sample_key": sample.key,
            "weight_versions": part.response_versions,
            "response_sampling": part.response_sampling,
        },
    }


def skyrl_generator_output(samples: Sequence[TrainingSample]) -> dict[str, Any]:
    """A batch as SkyRL's ``GeneratorOutput``; a sample without a reward gets 0.0 (SkyRL's
    rewards are plain floats), so filter those out first where 0 would mislead."""
    parts = [split(sample) for sample in samples]
    return {
        "prompt_token_ids": [p.prompt_ids for p in parts],
        "response_ids": [p.response_ids for p in parts],
        "rewards": [sample.reward if sample.reward is not None else 0.0 for sample in samples],
        "loss_masks": [p.response_mask for p in parts],
        "rollout_logprobs": [p.response_logprobs for p in parts],
        "stop_reasons": None,
        "rollout_metrics": None,
        "response_sampling": [p.response_sampling for p in parts],
    }


__all__ = ["Split", "skyrl_generator_output", "split", "verl_agent_loop_output"]
