"""The distribution a call's tokens were sampled from: its sampling provenance (DESIGN §4.7).

The captured logprob of a generated token is the engine's *processed* logprob: of the
distribution after temperature, min-p, top-k and top-p, renormalized over the tokens
kept. A trainer that compares its own logprob with it must compute the same processed
distribution, so every captured call records the options that shaped it, in the row's
extras under ``EXTRAS_SAMPLING`` (covered by the extras digest) and on the sample's span.

Only options that are not neutral are written; a call sampled from the plain distribution
writes ``{}``, so a reader tells it from a call captured before provenance existed (no
``sampling`` at all: unknown, read as temperature 1 with nothing filtered, and counted).
``unreplayable`` names options the engine applied that no trainer can replay from the
sample (a grammar's mask, a thinking budget, a custom logits processor).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

EXTRAS_SAMPLING = "sampling"
"""Row-extras key of a call's non-neutral sampling options (``SamplingProvenance.extras``)."""

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class SamplingProvenance(BaseModel):
    """The sampling options of one call; each field's default is its neutral value."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    """0: greedy, whose logprobs are of the plain logits (vLLM scales by 1 and filters nothing)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    """0: off (vLLM's -1 is written as 0)."""
    min_p: Probability = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, JSON's only key type) to the bias added to its logit."""
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    unreplayable: list[str] | None = None
    """Options applied that a trainer cannot replay from the sample, by name."""

    @model_validator(mode="before")
    @classmethod
    def _absent_as_neutral(cls, data: Any) -> Any:
        """A column store writes every field (a null there is an option not given) and the
        logit bias as a list of ``{token_id, bias}``."""
        if not isinstance(data, dict):
            return data
        values = {name: value for name, value in data.items() if value is not None}
        bias = values.get("logit_bias")
        if isinstance(bias, list) and all(isinstance(item, dict) for item in bias):
            values["logit_bias"] = {item.get("token_id"): item.get("bias") for item in bias}
        return values

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def scale(self) -> float:
        """What the logits are divided by before filtering (1 for greedy decoding)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def truncates(self) -> bool:
        """Whether tokens are filtered out of the sampled distribution (never when greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def not_replayed(self) -> list[str]:
        """Options the trainers' replay (``stages.trainer.replay``) does not apply: the
        penalties and token masks depend on the tokens before, which it leaves to later work,
        and the options named ``unreplayable`` cannot be replayed at all."""
        given = self.model_dump(exclude_defaults=True)
        return sorted(name for name in given if name not in REPLAYED)

    def extras(self) -> dict[str, Any]:
        """The non-neutral options, as the row's extras and the span carry them."""
        return self.model_dump(exclude_defaults=True)


GREEDY_BELOW = 1e-5
"""vLLM's threshold: a temperature below it decodes greedily."""

REPLAYED = frozenset({"temperature", "top_p", "top_k", "min_p"})
"""The options a trainer's replay applies (``stages.trainer.replay``)."""

NEUTRAL = SamplingProvenance()


def provenance_of(extras: dict[str, Any] | None) -> SamplingProvenance | None:
    """The provenance a row's extras record (``NEUTRAL`` for ``{}``), None when they record
    none (captured before provenance, or an engine that handed none over). Raises
    ``ValueError`` naming the field when it is malformed."""
    raw = (extras or {}).get(EXTRAS_SAMPLING)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"extras.{EXTRAS_SAMPLING}: expected an object, got {type(raw).__name__}")
    try:
        return SamplingProvenance.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"extras.{EXTRAS_SAMPLING}.{where}: {first['msg']}") from None


__all__ = ["EXTRAS_SAMPLING", "GREEDY_BELOW", "NEUTRAL", "REPLAYED", "SamplingProvenance", "provenance_of"]
