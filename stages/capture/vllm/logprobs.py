"""The sampled token's logprob of a captured request, without vLLM's per-token logprob objects.

A row needs one float per generated token, which vLLM's sampler already has. Asking
vLLM for ``logprobs=0`` gets it, but vLLM's output processor (in the API process) then
detokenizes every logprob token and builds a ``Logprob`` per position, for a reply
that would list them: work a captured request whose client did not ask for logprobs
throws away. ``SampledLogprobs`` keeps the float and nothing else; ``SampledLogprobHook``
gives it to exactly the requests that carry ``SAMPLED_ONLY`` in their sampling
parameters' ``extra_args`` (set by the capturing engine client), on the output processor
of the engine the worker owns. A request that asked for logprobs itself keeps vLLM's
own processing, so its reply lists them as vLLM would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists

SAMPLED_ONLY = "tokentrail_sampled_logprob_only"
"""``extra_args`` key of a captured request whose reply lists no logprobs."""


class SampledLogprobs(LogprobsProcessor):  # type: ignore[misc]
    """``LogprobsProcessor`` whose ``logprobs`` is a plain list: the sampled token's
    logprob per generated position (the sampler puts it first in every row)."""

    def _update_sample_logprobs(self, logprobs_lists: LogprobsLists) -> None:
        values: list[float] = np.asarray(logprobs_lists.logprobs)[:, 0].tolist()
        self.logprobs.extend(values)
        self.cumulative_logprob += sum(values)

    @classmethod
    def replacing(cls, processor: LogprobsProcessor) -> SampledLogprobs:
        """This processor in place of vLLM's, before the request's first output (prompt
        logprobs, if the client asked for them, keep vLLM's handling and its tokenizer)."""
        return cls(
            tokenizer=processor.tokenizer,
            logprobs=[],
            prompt_logprobs=processor.prompt_logprobs,
            cumulative_logprob=0.0,
            num_logprobs=processor.num_logprobs,
            num_prompt_logprobs=processor.num_prompt_logprobs,
        )


class SampledLogprobHook:
    """Installed on an ``OutputProcessor``: requests marked ``SAMPLED_ONLY`` get ``SampledLogprobs``.

    It wraps the processor's ``add_request`` on that instance only: vLLM's classes and
    every other engine are untouched. ``on`` installs it once per processor.
    """

    def __init__(self, output_processor: Any) -> None:
        self.output_processor = output_processor
        self._add_request: Callable[..., None] = output_processor.add_request
        self.replaced = 0
        """Requests given ``SampledLogprobs`` so far."""
        output_processor.add_request = self.add_request

    @classmethod
    def on(cls, output_processor: Any) -> SampledLogprobHook:
        """The processor's hook: the one already installed (a later client on the same
        engine), else a new one."""
        installed = getattr(output_processor.add_request, "__self__", None)
        return installed if isinstance(installed, cls) else cls(output_processor)

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self._add_request(request, *args, **kwargs)
        params = request.sampling_params
        if params is None or not (params.extra_args or {}).get(SAMPLED_ONLY):
            return
        state = self.output_processor.request_states.get(request.request_id)
        processor = None if state is None else state.logprobs_processor
        if processor is not None and not isinstance(processor, SampledLogprobs):
            state.logprobs_processor = SampledLogprobs.replacing(processor)
            self.replaced += 1


__all__ = ["SAMPLED_ONLY", "SampledLogprobHook", "SampledLogprobs"]
