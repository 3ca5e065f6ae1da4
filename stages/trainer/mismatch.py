"""How far the trainer's logprobs are from the behaviour's, and where (DESIGN §14.1).

A pure rule over one batch: given, for every generated token, the logprob it was sampled
with (the behaviour policy ``μ``, captured by the engine) and the trainer's logprob of the
same processed distribution (``π``, ``stages.trainer.replay``), it measures the
training-inference mismatch the way the field does, and then splits it by what only a
log of per-token provenance knows. The callers (the trainers) do the forward passes.

With ``Δ = log π - log μ`` and the importance ratio ``w = exp(Δ)``, over tokens drawn
from ``μ``:
- ``k1 = E[-Δ]`` and ``k3 = E[w - 1 - Δ]`` estimate KL(μ‖π) (k3 is never negative);
- ``log_ppl_diff``: the mean over sequences of log perplexity under π minus under μ;
- ``chi2_token = E[w²] - 1`` and ``chi2_sequence`` with the sequence ratio ``exp(ΣΔ)``;
- ``ess_token``/``ess_sequence``: ``(Σw)² / (n Σw²)``, 1 when every ratio is equal;
- the raw ratio's min, mean, p99, max and ``max_abs_dev = max |w - 1|``, before any correction;
- the corrections, each with the fraction it touches: truncated importance sampling
  (``tis``, ratios capped at ``tis_cap``) and masked importance sampling with two-sided
  bounds as in IcePop (``mis``, ratios outside ``[mis_low, mis_high]`` masked), at token,
  sequence and geometric-mean (``exp(mean Δ)`` per sequence) level.

The buckets (token metrics per bucket): ``clean`` versus ``straddled`` (the token's call
spans a refit), ``lag`` (how many versions the token's weights are behind the trainer),
``turn`` (its call's index in the chain), ``after_tool`` versus ``later`` (the first
tokens of a call after a tool result, ``stages.trainer.batch.AFTER_TOOL_TOKENS``). And
the ``worst`` tokens by ``|Δ|``, each with its sample, call, turn, position, version, rank
and ``log S``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from topics.records import TrainingSample


@dataclass(frozen=True, slots=True)
class Bounds:
    """The corrections' bounds and the report's length."""

    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    worst: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.mis_low <= 1 <= self.mis_high:
            raise ValueError(
                f"mis_low, mis_high: need 0 < low <= 1 <= high, got {self.mis_low}, {self.mis_high}"
            )
        if self.tis_cap < 1:
            raise ValueError(f"tis_cap: must be >= 1, got {self.tis_cap}")
        if self.worst < 0:
            raise ValueError(f"worst: must be >= 0, got {self.worst}")


@dataclass(frozen=True, slots=True)
class Tokens:
    """The batch's generated tokens, flat (``n`` of them), with where each lies."""

    behaviour: torch.Tensor
    """``[n]`` the logprob each token was sampled with."""
    trainer: torch.Tensor
    """``[n]`` the trainer's logprob of the same processed distribution."""
    sample: torch.Tensor
    """``[n]`` int64: the index of the token's sample in ``samples``."""
    position: torch.Tensor
    """``[n]`` int64: the token's position in its sample."""
    version: torch.Tensor
    turn: torch.Tensor
    straddled: torch.Tensor
    after_tool: torch.Tensor
    log_kept: torch.Tensor
    """``[n]`` the trainer's ``log S`` (0 where nothing was filtered)."""
    rank: torch.Tensor

    def __post_init__(self) -> None:
        n = self.behaviour.shape
        for name in (
            "trainer",
            "sample",
            "position",
            "version",
            "turn",
            "straddled",
            "after_tool",
            "log_kept",
            "rank",
        ):
            if getattr(self, name).shape != n:
                raise ValueError(
                    f"{name}: shape {tuple(getattr(self, name).shape)} != behaviour's {tuple(n)}"
                )


def concat(parts: Sequence[Tokens]) -> Tokens:
    """The tokens of several batches as one (their ``sample`` indices already distinct)."""
    names = Tokens.__slots__
    if not parts:
        empty = torch.zeros(0)
        return Tokens(
            **{name: empty.bool() if name in ("straddled", "after_tool") else empty for name in names}
        )
    return Tokens(**{name: torch.cat([getattr(part, name) for part in parts]) for name in names})


def report(
    tokens: Tokens,
    samples: Sequence[TrainingSample],
    *,
    policy_version: int,
    bounds: Bounds | None = None,
) -> dict[str, Any]:
    """The batch's mismatch report: overall metrics, buckets and worst tokens (a JSON object)."""
    bounds = bounds or Bounds()
    delta = (tokens.trainer - tokens.behaviour).double()
    lag = policy_version - tokens.version
    buckets: dict[str, Any] = {
        "clean": _token_metrics(delta[~tokens.straddled], bounds),
        "straddled": _token_metrics(delta[tokens.straddled], bounds),
        "after_tool": _token_metrics(delta[tokens.after_tool], bounds),
        "later": _token_metrics(delta[~tokens.after_tool], bounds),
        "lag": _by_value(delta, lag, bounds),
        "turn": _by_value(delta, tokens.turn, bounds),
    }
    return {
        **metrics(delta, tokens.sample, bounds),
        "buckets": buckets,
        "worst": _worst(tokens, delta, lag, samples, bounds.worst),
    }


def metrics(delta: torch.Tensor, sequence: torch.Tensor, bounds: Bounds) -> dict[str, Any]:
    """Every metric of the module's docstring for the tokens' ``Δ``, grouped by ``sequence``."""
    out = _token_metrics(delta, bounds)
    if not len(delta):
        return (
            out
            | {name: None for name in ("log_ppl_diff", "chi2_sequence", "ess_sequence")}
            | {"corrections": None}
        )
    groups, inverse = torch.unique(sequence, return_inverse=True)
    count = torch.zeros(len(groups), dtype=delta.dtype).index_add_(0, inverse, torch.ones_like(delta))
    total = torch.zeros(len(groups), dtype=delta.dtype).index_add_(0, inverse, delta)
    sequence_ratio = total.exp()
    geometric = (total / count).exp()
    weight = delta.exp()
    out["log_ppl_diff"] = float((-total / count).mean())
    out["chi2_sequence"] = float(sequence_ratio.pow(2).mean() - 1)
    out["ess_sequence"] = _ess(sequence_ratio)
    out["corrections"] = {
        level: _corrections(ratios, bounds)
        for level, ratios in (("token", weight), ("sequence", sequence_ratio), ("geometric", geometric))
    }
    return out


def _token_metrics(delta: torch.Tensor, bounds: Bounds) -> dict[str, Any]:
    n = len(delta)
    if n == 0:
        return {"tokens": 0, **{name: None for name in _TOKEN_NAMES}}
    weight = delta.exp()
    masked = (weight < bounds.mis_low) | (weight > bounds.mis_high)
    return {
        "tokens": n,
        "k1": float((-delta).mean()),
        "k3": float((weight - 1 - delta).mean()),
        "chi2_token": float(weight.pow(2).mean() - 1),
        "ess_token": _ess(weight),
        "ratio_min": float(weight.min()),
        "ratio_mean": float(weight.mean()),
        "ratio_p99": float(torch.quantile(weight, 0.99)),
        "ratio_max": float(weight.max()),
        "max_abs_dev": float((weight - 1).abs().max()),
        "max_abs_log_ratio": float(delta.abs().max()),
        "mis_masked_fraction": float(masked.double().mean()),
    }


_TOKEN_NAMES = (
    "k1",
    "k3",
    "chi2_token",
    "ess_token",
    "ratio_min",
    "ratio_mean",
    "ratio_p99",
    "ratio_max",
    "max_abs_dev",
    "max_abs_log_ratio",
    "mis_masked_fraction",
)


def _ess(weight: torch.Tensor) -> float:
    return float(weight.sum().pow(2) / (len(weight) * weight.pow(2).sum()))


def _corrections(ratios: torch.Tensor, bounds: Bounds) -> dict[str, float]:
    """The fraction each correction touches at one level (tokens, or sequences)."""
    return {
        "tis_clipped_fraction": float((ratios > bounds.tis_cap).double().mean()),
        "mis_masked_fraction": float(
            ((ratios < bounds.mis_low) | (ratios > bounds.mis_high)).double().mean()
        ),
    }


def _by_value(delta: torch.Tensor, label: torch.Tensor, bounds: Bounds) -> dict[str, Any]:
    return {str(int(value)): _token_metrics(delta[label == value], bounds) for value in torch.unique(label)}


def _worst(
    tokens: Tokens, delta: torch.Tensor, lag: torch.Tensor, samples: Sequence[TrainingSample], count: int
) -> list[dict[str, Any]]:
    order = torch.argsort(delta.abs(), descending=True, stable=True)[:count]
    worst: list[dict[str, Any]] = []
    for i in order.tolist():
        sample = samples[int(tokens.sample[i])]
        turn = int(tokens.turn[i])
        worst.append(
            {
                "sample_key": sample.key,
                "call_id": sample.spans[turn].call_id,
                "turn": turn,
                "position": int(tokens.position[i]),
                "token_id": sample.token_ids[int(tokens.position[i])],
                "weight_version": int(tokens.version[i]),
                "lag": int(lag[i]),
                "behaviour_logprob": float(tokens.behaviour[i]),
                "trainer_logprob": float(tokens.trainer[i]),
                "delta": float(delta[i]),
                "rank": int(tokens.rank[i]),
                "log_kept": float(tokens.log_kept[i]),
                "straddled": bool(tokens.straddled[i]),
            }
        )
    return worst


__all__ = ["Bounds", "Tokens", "concat", "metrics", "report"]
