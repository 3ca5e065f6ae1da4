"""Capture's sampler hook gives exactly the tensors of vLLM's own ``gather_logprobs`` for ``k`` = 0."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.sampler import Sampler

from stages.capture.vllm.engine import EngineSettings
from stages.capture.vllm.sampler import CaptureCPUWorker, gather_sampled


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_gather_sampled_equals_vllms_gather_for_the_sampled_token(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 1024, generator=generator)
    logits[:, :8] = logits[:, :1]  # ties: the rank counts every token at least as likely
    logprobs = torch.log_softmax(logits, dim=-1)
    sampled = torch.randint(0, 1024, (rows,), generator=generator)
    sampled[0] = 3  # one of the tied tokens
    ours, theirs = gather_sampled(logprobs, 0, sampled), Sampler.gather_logprobs(logprobs, 0, sampled)
    for mine, vllms in zip(ours[:3], theirs[:3], strict=True):
        assert mine.dtype == vllms.dtype and mine.shape == vllms.shape
        assert torch.equal(mine, vllms)
    assert int(ours.selected_token_ranks[0]) >= 8


def test_other_k_go_to_vllm() -> None:
    logprobs = torch.log_softmax(torch.randn(4, 64), dim=-1)
    sampled = torch.randint(0, 64, (4,))
    ours, theirs = gather_sampled(logprobs, 3, sampled), Sampler.gather_logprobs(logprobs, 3, sampled)
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], theirs[:3], strict=True))


def test_the_engine_runs_capture_s_worker_unless_told_not_to() -> None:
    path = f"{CaptureCPUWorker.__module__}.{CaptureCPUWorker.__name__}"
    assert EngineSettings(model="m").engine_kwargs()["worker_cls"] == path
    assert "worker_cls" not in EngineSettings(model="m", sampled_logprob_sampler=False).engine_kwargs()
