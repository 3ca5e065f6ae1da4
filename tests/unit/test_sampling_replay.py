"""The trainers' replay of a call's processed distribution, against vLLM's own sampler ops."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from stages.trainer.replay import replay

VOCAB = 97


def vllm_processed(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """vLLM's processed logprobs for one setting: its temperature division, its min-p rule
    (``MinPLogitsProcessor.apply``), then its top-k/top-p op, then log-softmax."""
    scaled = logits.clone() / temperature
    if min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, -torch.inf)
    k = torch.full((len(logits),), top_k) if top_k > 0 else None
    p = torch.full((len(logits),), top_p) if top_p < 1 else None
    return apply_top_k_top_p_pytorch(scaled, k, p).log_softmax(-1)


SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 20, 0.8, 0.0),
    (0.6, 20, 0.95, 0.0),
    (1.3, 0, 0.5, 0.0),
    (0.9, 5, 1.0, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.8, 40, 0.9, 0.02),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), SETTINGS)
def test_replay_equals_vllm_processing(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB) * 3
    expected = vllm_processed(logits, temperature, top_k, top_p, min_p)
    kept = expected.isfinite()
    taken = torch.multinomial(expected.exp(), 1).squeeze(-1)  # sampled from the processed distribution
    n = len(logits)
    got = replay(
        logits,
        taken,
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k),
        top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p),
    )
    want = expected.gather(-1, taken[:, None]).squeeze(-1)
    assert torch.allclose(got.logprobs, want, atol=1e-5)
    scaled = torch.log_softmax(logits / temperature, -1)
    kept_mass = torch.logsumexp(scaled.masked_fill(~kept, -torch.inf), -1)
    assert torch.allclose(got.log_kept, kept_mass, atol=1e-5)
    # for a kept token, processed = scaled - log S: the bias an unreplayed ratio carries
    assert torch.allclose(
        got.logprobs, scaled.gather(-1, taken[:, None]).squeeze(-1) - got.log_kept, atol=1e-5
    )
    assert bool((got.log_kept < 0).all()) == (top_k > 0 or top_p < 1 or min_p > 0)
    assert bool((got.rank >= 1).all())


def test_rows_with_different_calls_replay_each_their_own() -> None:
    torch.manual_seed(1)
    logits = torch.randn(len(SETTINGS), VOCAB) * 3
    taken = torch.zeros(len(SETTINGS), dtype=torch.long)
    columns = list(zip(*SETTINGS, strict=True))
    got = replay(
        logits,
        taken,
        temperature=torch.tensor(columns[0]),
        top_k=torch.tensor(columns[1]),
        top_p=torch.tensor(columns[2]),
        min_p=torch.tensor(columns[3]),
    )
    for row, setting in enumerate(SETTINGS):
        expected = vllm_processed(logits[row : row + 1], *setting)[0, 0]
        assert float(got.logprobs[row]) == pytest.approx(float(expected), abs=1e-5)


def test_replay_is_differentiable_in_the_logits() -> None:
    logits = torch.randn(4, VOCAB, requires_grad=True)
    got = replay(
        logits,
        logits.detach().argmax(-1),
        temperature=torch.full((4,), 0.7),
        top_k=torch.full((4,), 10),
        top_p=torch.full((4,), 0.9),
        min_p=torch.zeros(4),
    )
    got.logprobs.sum().backward()
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)


def test_a_filtered_token_has_no_probability() -> None:
    logits = torch.tensor([[5.0, 4.0, -3.0, -4.0]])
    got = replay(
        logits,
        torch.tensor([3]),
        temperature=torch.ones(1),
        top_k=torch.tensor([2]),
        top_p=torch.ones(1),
        min_p=torch.zeros(1),
    )
    assert float(got.logprobs[0]) == float("-inf")
    assert int(got.rank[0]) == 4
