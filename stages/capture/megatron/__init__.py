"""The Megatron-Core adapter: capture hooks that never block the engine step.

Upstream capture resolves the prefix and writes the token row inside the engine step,
so the whole model-parallel group waits on every data-plane read and write. Here the
engine's two hooks (``prompt_preparer`` and ``payload_stager``, on Megatron-LM main
since PR 7015; megatron-core 0.19.2 has neither) do in-memory work only.

- ``preparer``: the ``prompt_preparer`` hook (``MegatronPromptPreparer``): prefixes
  prefetched before admission, looked up (never waited on) and spliced inside the step.
- ``stager``: the ``payload_stager`` hook (``MegatronPayloadStager``): the row and its
  coords built inside the step, the row handed to the background writer.
- ``install``: feature-detecting the two hooks on an engine and installing them.
- ``admission``: the ``ng_capture`` admission as both hooks read it from ``offload_params``.
- ``registry``: prepared calls handed from the prefetch to the hooks, across threads.
- ``handoff``: the non-blocking hand-off from the engine's thread to the capture loop.
- ``payload``: reading and validating a finished request (ids, logprobs, policy epochs).
"""
