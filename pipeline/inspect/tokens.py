"""A sample's tokens as one HTML string: the browser parses it once, with no per-token DOM
calls, so a 32K-token sample opens without freezing the page (DESIGN §16).

Every token is a focusable span carrying its id, mask, logprob, weight version and call;
generated tokens (mask 1) are shaded by probability on viridis, a colour-blind-safe
scale, prompt and tool tokens (mask 0) are drawn apart, unshaded. Call boundaries are
separate elements without a token id. A call whose tokens were sampled across a refit
(its weight version changes inside its span) has the first token of the new version
marked ``refit``, titled with the change, so a straddle is found without hovering.

Beside a train step the trainer recorded (``pipeline.trainer.steplog``), each generated
token also carries the trainer's logprob and ``Δ = trainer − behaviour``, and is shaded
by ``|Δ|`` instead (``DIFF_BOUNDS``): the tokens that drift are found at a glance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape
from tokenizers import Tokenizer

SHADES = 10
"""Probability buckets; ``static/inspect.css`` gives ``.v0`` … ``.v9`` viridis colours."""

DIFF_BOUNDS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""|Δ| bucket edges; ``static/inspect.css`` gives ``.d0`` (below 1e-4) … ``.d5`` (1 and above)."""

Decoder = Callable[[int], str]


def load_decoder(model_dir: Path) -> Decoder | None:
    """Decodes one id to its text with the run's own tokenizer; None when the model is gone."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return decode


def shade(logprob: float) -> int:
    return min(SHADES - 1, int(math.exp(logprob) * SHADES))


def diff_shade(delta: float) -> int:
    """The ``.dN`` bucket of a logprob difference."""
    return sum(abs(delta) >= edge for edge in DIFF_BOUNDS)


@dataclass(frozen=True, slots=True)
class TokenView:
    """One archived sample and its rendering."""

    sample_key: str
    rollout_id: str
    group_id: str | None
    run_id: str
    reward: float | None
    length: int
    generated: int
    calls: int
    straddles: int
    """Tokens where the weight version changes inside one call's span."""
    html: Markup
    sampling: tuple[tuple[str, str], ...] = ()
    """Each call's sampling options as a label (``sampling_label``), in call order."""
    step: str | None = None
    """The train step whose trainer logprobs the view shows beside the behaviour's."""
    max_abs_delta: float | None = None


def sampling_label(options: Mapping[str, Any] | None) -> str:
    """What a call's recorded options (a span's ``sampling``, DESIGN §4.7) say its logprobs
    are of, for a person: the options, the plain distribution, or unknown."""
    if options is None:
        return "unknown (captured before sampling was recorded): read as the plain distribution"
    if not options:
        return "the plain distribution (temperature 1, nothing filtered)"
    return ", ".join(f"{name} {value}" for name, value in options.items())


def render_tokens(
    record: Mapping[str, Any],
    decode: Decoder | None,
    *,
    step: str | None = None,
    trainer_logprobs: Sequence[float] | None = None,
) -> TokenView:
    """``record`` is an archive line (``pipeline.samples.archive``); ``trainer_logprobs``, at
    the sample's length, are step ``step``'s (raises ``ValueError`` at another length)."""
    if trainer_logprobs is not None and len(trainer_logprobs) != len(record["token_ids"]):
        raise ValueError(
            f"trainer_logprobs of step {step}: {len(trainer_logprobs)} values for "
            f"{len(record['token_ids'])} tokens of sample {record.get('sample_key')}"
        )
    ids: Sequence[int] = record["token_ids"]
    mask: Sequence[float] = record["token_mask"]
    logprobs: Sequence[float] = record["logprobs"]
    versions: Sequence[int] = record["weight_versions"]
    spans = record.get("spans", [])
    starts = {int(span["start"]): str(span["call_id"]) for span in spans}
    sampled = {str(span["call_id"]): sampling_label(span.get("sampling")) for span in spans}
    parts: list[str] = []
    call = ""
    straddles = 0
    worst: float | None = None
    for i, token_id in enumerate(ids):
        title = ""
        if i in starts:
            call = starts[i]
            parts.append(
                f'<span class="cb" title="call {escape(call)}, sampled from: {escape(sampled[call])}" '
                f'data-sampling="{escape(sampled[call])}">{escape(call)}</span>'
            )
        generated = mask[i] >= 0.5
        classes = f"t m1 v{shade(logprobs[i])}" if generated else "t m0"
        trainer = ""
        if generated and trainer_logprobs is not None:
            delta = float(trainer_logprobs[i]) - float(logprobs[i])
            worst = abs(delta) if worst is None else max(worst, abs(delta))
            classes = f"t m1 d{diff_shade(delta)}"
            trainer = (
                f' id="p{i}" data-trainer-logprob="{float(trainer_logprobs[i])!r}" data-delta="{delta!r}"'
            )

        if call and i not in starts and versions[i] != versions[i - 1]:
            straddles += 1
            classes += " refit"
            title = f' title="weight version {versions[i - 1]} → {versions[i]}"'
        piece = decode(token_id) if decode is not None else f"⟨{token_id}⟩"
        parts.append(
            f'<span class="{classes}"{title} tabindex="0" data-token-id="{token_id}" data-mask="{int(generated)}" '
            f'data-logprob="{float(logprobs[i])!r}"{trainer} data-version="{versions[i]}" data-call="{escape(call)}">'
            f"{escape(piece) or '∅'}</span>"
        )
    return TokenView(
        sample_key=str(record.get("sample_key") or record["rollout_id"]),
        rollout_id=str(record["rollout_id"]),
        group_id=record.get("group_id"),
        run_id=str(record["run_id"]),
        reward=record.get("reward"),
        length=len(ids),
        generated=sum(1 for m in mask if m >= 0.5),
        calls=len(starts),
        straddles=straddles,
        html=Markup("".join(parts)),
        sampling=tuple(sampled.items()),
        step=step,
        max_abs_delta=worst,
    )
