"""The sampled token's logprob in the engine's sampler, without the general top-k path.

Every captured call asks the engine for ``logprobs=0``: the sampled token's logprob and
its rank. vLLM's ``Sampler.gather_logprobs`` serves any ``k``: a top-k, two
concatenations, and the rank through a ``torch.compile``d kernel whose per-call guard
checks cost more than the count itself on small batches (a CPU host's engine spends
most of its logprob time there). For ``k`` = 0 ``gather_sampled`` computes the same
three tensors directly: the sampled token's id and logprob, and its rank as the number
of tokens at least as likely (vLLM's definition). Any other ``k`` goes to vLLM.

The engine process loads ``CaptureCPUWorker`` / ``CaptureGPUWorker`` (vLLM's
``worker_cls``, chosen by ``EngineSettings``): vLLM's own worker, whose model runner's
sampler gets ``gather_sampled`` in place of its ``gather_logprobs``, on that instance.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker


def gather_sampled(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """``Sampler.gather_logprobs`` (same tensors, same dtypes), computed directly for ``k`` = 0."""
    if num_logprobs != 0:
        return Sampler.gather_logprobs(logprobs, num_logprobs, token_ids)
    ids = token_ids.unsqueeze(-1)
    sampled = logprobs.gather(-1, ids)
    ranks = (logprobs >= sampled).sum(-1)
    return LogprobsTensors(ids.to(torch.int32), sampled, ranks)


class _SampledFirst:
    """Gives the model runner's sampler ``gather_sampled`` once the device is set up."""

    model_runner: Any

    def init_device(self) -> None:
        super().init_device()  # type: ignore[misc]
        sampler = getattr(self.model_runner, "sampler", None)
        if isinstance(sampler, Sampler):  # vLLM's V1 model runner (the V2 one samples elsewhere)
            sampler.gather_logprobs = gather_sampled


class CaptureCPUWorker(_SampledFirst, CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker with ``gather_sampled``."""


class CaptureGPUWorker(_SampledFirst, Worker):  # type: ignore[misc]
    """vLLM's GPU worker with ``gather_sampled``."""


__all__ = ["CaptureCPUWorker", "CaptureGPUWorker", "gather_sampled"]
