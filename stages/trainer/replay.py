"""The trainer's logprob of the distribution a token was sampled from (DESIGN §4.7).

A captured logprob is of the engine's processed distribution: the logits divided by the
call's temperature, then min-p, top-k and top-p filtering, renormalized over the tokens
kept. An importance ratio is only meaningful against the same distribution, so the
trainer replays that processing on its own logits, per token, with the options its call
recorded. Under truncation the unreplayed ratio is off by exactly the kept mass ``S``
(``log p_processed = log p_scaled - log S`` for a kept token); ``log_kept`` reports it.

The kept set is the trainer's own (its logits filtered by the call's options): on policy
it is the engine's set exactly, and off policy it is the set the trainer's policy would
have kept, which is the processed policy a trainer optimizes. The filtering follows
vLLM's sampler (``vllm.v1.sample``): min-p on the temperature-scaled probabilities, then
top-k (ties at the k-th value kept), then top-p over the top-k survivors in ascending
order (a token is dropped when the mass at or below it is at most ``1 - p``; the most
likely token always stays). Greedy calls (temperature 0) record logprobs of the plain
logits, so they are replayed at temperature 1 with nothing filtered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Replayed:
    """Per row of the input: the taken token's processed logprob, ``log S`` and its rank."""

    logprobs: torch.Tensor
    """``[N]``: the taken token's logprob under the processed distribution (-inf if filtered out)."""
    log_kept: torch.Tensor
    """``[N]``: log of the mass the filtering kept, of the temperature-scaled distribution (0: none)."""
    rank: torch.Tensor
    """``[N]`` int64: 1 + the number of tokens more likely than the taken one (vLLM counts ties too)."""
    entropy: torch.Tensor
    """``[N]``: the processed distribution's entropy (TRL's entropy metric and mask read it)."""


def replay(
    logits: torch.Tensor,
    taken: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> Replayed:
    """Process ``logits`` ``[N, V]`` as the engine did for each row's call and read ``taken`` ``[N]``.

    ``temperature`` ``[N]`` is already the scale (1 for greedy calls); ``top_k`` 0, ``top_p``
    1 and ``min_p`` 0 are off. Differentiable in ``logits`` (the kept set is a constant)."""
    scaled = logits.float() / temperature.unsqueeze(-1)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    with torch.no_grad():
        if bool((min_p > 0).any()):
            probs = torch.softmax(scaled, dim=-1)
            keep &= probs >= probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            keep &= _top_k_top_p(scaled.masked_fill(~keep, -torch.inf), top_k, top_p)
    filtered = scaled.masked_fill(~keep, -torch.inf)
    processed = torch.log_softmax(filtered, dim=-1)
    index = taken.unsqueeze(-1)
    chosen = processed.gather(-1, index).squeeze(-1)
    log_kept = torch.logsumexp(filtered, dim=-1) - torch.logsumexp(scaled, dim=-1)
    with torch.no_grad():
        rank = (processed >= processed.gather(-1, index)).sum(-1)
    entropy = -(processed.exp() * processed.masked_fill(~keep, 0.0)).sum(-1)
    return Replayed(chosen, log_kept.detach(), rank, entropy)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens top-k then top-p keep, per row (``logits`` already min-p filtered)."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).to(torch.long)
    kth = ascending.gather(-1, (vocab - k).unsqueeze(-1))
    ascending = ascending.masked_fill(ascending < kth, -torch.inf)
    below = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    dropped = (below <= (1 - top_p).unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
    dropped[:, -1] = False
    dropped |= ascending == -torch.inf
    keep = torch.empty_like(dropped)
    keep.scatter_(-1, order, ~dropped)
    return keep


__all__ = ["Replayed", "replay"]
