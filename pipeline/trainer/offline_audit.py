"""A past run's mismatch audited offline: exported samples under a Hugging Face model
loaded from disk (``tokentrail mismatch``), the same report every train step carries."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from pipeline.trainer.recompute import audit
from stages.trainer.mismatch import Bounds
from stages.trainer.settings import ReplayMode
from topics.records import TrainingSample


def audit_offline(
    model_dir: Path,
    samples: Sequence[TrainingSample],
    *,
    dtype: str,
    policy_version: int | None,
    mode: ReplayMode,
    batch_size: int,
    bounds: Bounds,
) -> dict[str, Any]:
    """The report, headed by the model, its dtype and the policy version it stood for (None:
    the newest version in the samples). Raises ``ValueError`` for settings the audit refuses."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    version = policy_version
    if version is None:
        version = max(max(sample.weight_versions) for sample in samples)
    report = audit(model, samples, policy_version=version, mode=mode, batch_size=batch_size, bounds=bounds)
    return {"model": str(model_dir), "dtype": dtype, "policy_version": version, **report}


def provenance_note(report: dict[str, Any]) -> str | None:
    """What the report assumed for generated tokens without sampling provenance, if any."""
    unknown = report["provenance_unknown_tokens"]
    if not unknown:
        return None
    return (
        f"{unknown} of {report['tokens']} generated tokens have no sampling provenance (captured "
        "before it was recorded, or by an engine that hands none over): assumed temperature 1, "
        "nothing filtered"
    )
