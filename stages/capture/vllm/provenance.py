"""A captured call's sampling provenance, read from the parameters vLLM samples it with.

The capturing engine client sees each request's ``SamplingParams`` as the engine gets
them: after the serving layer merged the request's options over the model's
``generation_config.json`` defaults (vLLM's ``generation_config="auto"``). So what is
recorded here is what the sampler applied, whichever route and whichever client set it.
"""

from __future__ import annotations

from typing import Any

from topics.sampling import SamplingProvenance


def provenance_of_params(params: Any) -> SamplingProvenance:
    """The provenance of vLLM ``SamplingParams`` (greedy: vLLM has already neutralized
    top-k, top-p and min-p)."""
    values: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": max(int(params.top_k), 0),
        "min_p": float(params.min_p),
        "repetition_penalty": float(params.repetition_penalty),
        "frequency_penalty": float(params.frequency_penalty),
        "presence_penalty": float(params.presence_penalty),
        "min_tokens": int(params.min_tokens),
    }
    if params.logit_bias:
        values["logit_bias"] = {str(token): float(bias) for token, bias in sorted(params.logit_bias.items())}
    if params.allowed_token_ids:
        values["allowed_token_ids"] = [int(token) for token in params.allowed_token_ids]
    if params.bad_words:
        values["bad_words"] = list(params.bad_words)
    unreplayable = [
        name
        for name in ("structured_outputs", "thinking_token_budget")
        if getattr(params, name, None) is not None
    ]
    if unreplayable:
        values["unreplayable"] = unreplayable
    return SamplingProvenance.model_validate(values)


__all__ = ["provenance_of_params"]
