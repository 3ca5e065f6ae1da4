"""Benchmark only: samples that state a wrong sampling temperature to the trainer.

A trainer and an engine that disagree on the temperature (a config drift, a default read
on one side only) is the commonest way the captured logprobs stop being those of the
distribution the trainer scores. ``tokentrail run --shift-behaviour-temperature T``
reproduces it on purpose: every call of every fed sample claims it was sampled at ``T``,
so the trainer replays ``T`` while the captured logprobs stay those of the temperature
that did sample. ``bench learning`` runs the loop with and without it, to show the
mismatch report and the trainers' importance corrections react. Never on a default path.
"""

from __future__ import annotations

from topics.records import TrainingSample


def shift_behaviour_temperature(sample: TrainingSample, temperature: float) -> TrainingSample:
    """``sample`` with every call that records its sampling restated at ``temperature``
    (a call without provenance stays unknown)."""
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    spans = [
        span
        if span.sampling is None
        else span.model_copy(
            update={"sampling": span.sampling.model_copy(update={"temperature": temperature})}
        )
        for span in sample.spans
    ]
    return sample.model_copy(update={"spans": spans})


__all__ = ["shift_behaviour_temperature"]
