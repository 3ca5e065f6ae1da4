"""A trainer's batch: verified samples as padded tensors, with GRPO advantages.

Positions line up with the sample: ``old_logprobs[b, i]`` is the sampled logprob of
``input_ids[b, i]`` (0 where ``loss_mask`` is 0), so a trainer compares it with the
log-softmax of the logits at position ``i - 1``. Advantages are normalized within each
GRPO group, over the samples that stay in the batch (every chain of a multi-sample
rollout counts, each with its rollout's reward): ``(r - mean) / (std + 1e-6)``, 0 for a
group of one (``stages.trainer.advantages``). A sample whose rollout has no reward keeps
its tokens but trains with weight 0 and advantage 0.

Every generated token also carries the sampling options of its call (DESIGN §4.7), as
the tensors a trainer's replay reads (``stages.trainer.replay``), and where it lies in
its rollout (turn, refit straddle, right after a tool result) for the mismatch report's
buckets (``stages.trainer.mismatch``). A call without provenance is replayed at
temperature 1 with nothing filtered, and its tokens are counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stages.finalize.reader import Group
from stages.trainer.advantages import group_advantages
from stages.trainer.staleness import StaleMeasure, StaleMode, StalenessPolicy
from topics.records import TrainingSample
from topics.sampling import NEUTRAL

AFTER_TOOL_TOKENS = 4
"""How many of a later call's first generated tokens count as right after a tool (or
user) result: where a stale prefix cache or a splice would show first."""


@dataclass(slots=True)
class TrainBatch:
    """Tensors of ``B`` samples padded to the longest (``T`` positions), plus where they came from."""

    input_ids: torch.Tensor
    """``[B, T]`` int64, padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """``[B, T]`` int64: 1 on the sample's tokens."""
    loss_mask: torch.Tensor
    """``[B, T]`` float32: 1 on generated tokens."""
    old_logprobs: torch.Tensor
    """``[B, T]`` float32: the logprob each token was sampled with."""
    rewards: torch.Tensor
    """``[B]`` float32 (NaN where the rollout has none)."""
    advantages: torch.Tensor
    """``[B]`` float32, normalized within each group."""
    sample_weights: torch.Tensor
    """``[B]`` float32: the staleness policy's weight (0 without a reward)."""
    weight_versions: torch.Tensor
    """``[B, 2]`` int64: the oldest and newest weight version of each sample's tokens
    (every token's version stays on ``samples[b].weight_versions``)."""
    staleness: torch.Tensor
    """``[B]`` int64: each sample's staleness as the policy measured it."""
    call_rewards: torch.Tensor
    """``[B, T]`` float32: each call's own reward (the seal's ``call_rewards``) on the last
    token of its span, 0 elsewhere and where the seal gave none."""
    token_versions: torch.Tensor
    """``[B, T]`` int64: each token's weight version (0 on padding)."""
    temperature: torch.Tensor
    """``[B, T]`` float32: what the token's call divided logits by (1 for greedy and padding)."""
    top_k: torch.Tensor
    """``[B, T]`` int64: its call's top-k (0: off)."""
    top_p: torch.Tensor
    """``[B, T]`` float32: its call's top-p (1: off)."""
    min_p: torch.Tensor
    """``[B, T]`` float32: its call's min-p (0: off)."""
    turn: torch.Tensor
    """``[B, T]`` int64: the index of the token's call in its sample's chain."""
    straddled: torch.Tensor
    """``[B, T]`` bool: the token's call has tokens of more than one weight version."""
    after_tool: torch.Tensor
    """``[B, T]`` bool: among the first ``AFTER_TOOL_TOKENS`` generated tokens of a call after the first."""
    provenance_unknown_tokens: int
    """Generated tokens of calls that record no provenance (captured before it was recorded)."""
    not_replayed_tokens: int
    """Generated tokens of calls with options the replay does not apply (penalties, masks, grammars)."""
    samples: list[TrainingSample]
    groups: list[Group]
    stale: list[str] = field(default_factory=list)
    """Keys of samples the staleness policy dropped (not in the tensors)."""

    def __len__(self) -> int:
        return len(self.samples)


def build_batch(
    groups: Sequence[Group], *, policy_version: int, staleness: StalenessPolicy, pad_id: int = 0
) -> TrainBatch:
    """One batch of every accepted sample of ``groups`` the staleness policy keeps."""
    kept: list[tuple[TrainingSample, float, int]] = []  # sample, weight, group index
    ages: list[int] = []
    stale: list[str] = []
    for index, group in enumerate(groups):
        for sample in group.samples:
            age = staleness.staleness(sample, policy_version)
            weight = staleness.weight(age)
            if weight is None:
                stale.append(sample.key)
            else:
                kept.append((sample, weight if sample.reward is not None else 0.0, index))
                ages.append(age)
    samples = [sample for sample, _, _ in kept]
    by_group: dict[int, list[float | None]] = {}  # kept lists each group's samples together
    for sample, _, index in kept:
        by_group.setdefault(index, []).append(sample.reward)
    advantages = [a for rewards in by_group.values() for a in group_advantages(rewards)]
    return _padded(
        samples,
        advantages=advantages,
        weights=[weight for _, weight, _ in kept],
        ages=ages,
        groups=list(groups),
        stale=stale,
        pad_id=pad_id,
    )


def audit_batch(samples: Sequence[TrainingSample], pad_id: int = 0) -> TrainBatch:
    """Samples as a batch to measure, not to train (``tokentrail mismatch``): no groups,
    advantage 0, weight 1, staleness 0."""
    n = len(samples)
    return _padded(
        samples, advantages=[0.0] * n, weights=[1.0] * n, ages=[0] * n, groups=[], stale=[], pad_id=pad_id
    )


def _padded(
    samples: Sequence[TrainingSample],
    *,
    advantages: list[float],
    weights: list[float],
    ages: list[int],
    groups: list[Group],
    stale: list[str],
    pad_id: int,
) -> TrainBatch:
    width = max((len(s.token_ids) for s in samples), default=0)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.int64)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    old_logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    call_rewards = torch.zeros((len(samples), width), dtype=torch.float32)
    tokens = TokenLayout.empty(len(samples), width)
    for row, sample in enumerate(samples):
        tokens.fill(row, sample)
        for position, reward in span_end_rewards(sample):
            call_rewards[row, position] = reward
        n = len(sample.token_ids)
        input_ids[row, :n] = torch.tensor(sample.token_ids, dtype=torch.int64)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.token_mask, dtype=torch.float32)
        old_logprobs[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        rewards=torch.tensor([_reward(s) for s in samples], dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        sample_weights=torch.tensor(weights, dtype=torch.float32),
        weight_versions=torch.tensor(
            [[min(s.weight_versions), max(s.weight_versions)] for s in samples], dtype=torch.int64
        ).reshape(len(samples), 2),
        staleness=torch.tensor(ages, dtype=torch.int64),
        call_rewards=call_rewards,
        token_versions=tokens.versions,
        temperature=tokens.temperature,
        top_k=tokens.top_k,
        top_p=tokens.top_p,
        min_p=tokens.min_p,
        turn=tokens.turn,
        straddled=tokens.straddled,
        after_tool=tokens.after_tool,
        provenance_unknown_tokens=tokens.unknown,
        not_replayed_tokens=tokens.not_replayed,
        samples=list(samples),
        groups=groups,
        stale=stale,
    )


@dataclass(slots=True)
class TokenLayout:
    """The per-token tensors of a batch that come from its samples' spans."""

    versions: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    turn: torch.Tensor
    straddled: torch.Tensor
    after_tool: torch.Tensor
    unknown: int = 0
    not_replayed: int = 0

    @classmethod
    def empty(cls, rows: int, width: int) -> TokenLayout:
        shape = (rows, width)
        return cls(
            versions=torch.zeros(shape, dtype=torch.int64),
            temperature=torch.ones(shape, dtype=torch.float32),
            top_k=torch.zeros(shape, dtype=torch.int64),
            top_p=torch.ones(shape, dtype=torch.float32),
            min_p=torch.zeros(shape, dtype=torch.float32),
            turn=torch.zeros(shape, dtype=torch.int64),
            straddled=torch.zeros(shape, dtype=torch.bool),
            after_tool=torch.zeros(shape, dtype=torch.bool),
        )

    def fill(self, row: int, sample: TrainingSample) -> None:
        self.versions[row, : len(sample.weight_versions)] = torch.tensor(sample.weight_versions)
        for turn, span in enumerate(sample.spans):
            begin = span.start + span.carry_len
            end = begin + span.gen_len
            sampling = span.sampling or NEUTRAL
            if span.sampling is None:
                self.unknown += span.gen_len
            elif sampling.not_replayed:
                self.not_replayed += span.gen_len
            self.temperature[row, begin:end] = sampling.scale
            self.top_k[row, begin:end] = 0 if sampling.greedy else sampling.top_k
            self.top_p[row, begin:end] = 1.0 if sampling.greedy else sampling.top_p
            self.min_p[row, begin:end] = 0.0 if sampling.greedy else sampling.min_p
            self.turn[row, span.start : end] = turn
            versions = self.versions[row, begin:end]
            self.straddled[row, begin:end] = bool(versions.min() != versions.max())
            if turn > 0:
                self.after_tool[row, begin : min(end, begin + AFTER_TOOL_TOKENS)] = True


def span_end_rewards(sample: TrainingSample) -> list[tuple[int, float]]:
    """(position, reward) of every call the seal rewarded: the last token of its span."""
    return [
        (span.start + span.carry_len + span.gen_len - 1, span.reward)
        for span in sample.spans
        if span.reward is not None
    ]


def unreplayable_spans(sample: TrainingSample) -> list[tuple[int, int]]:
    """``[begin, end)`` of the generated tokens of every call that applied an option no
    trainer can replay (§4.7): a trainer that masks them trains only what it can correct."""
    return [
        (span.start + span.carry_len, span.start + span.carry_len + span.gen_len)
        for span in sample.spans
        if span.sampling is not None and span.sampling.unreplayable
    ]


def _reward(sample: TrainingSample) -> float:
    return math.nan if sample.reward is None else sample.reward


__all__ = [  # the policy lives in its torch-free module; importable here as it always was
    "AFTER_TOOL_TOKENS",
    "StaleMeasure",
    "StaleMode",
    "StalenessPolicy",
    "TokenLayout",
    "TrainBatch",
    "audit_batch",
    "build_batch",
    "span_end_rewards",
    "unreplayable_spans",
]
