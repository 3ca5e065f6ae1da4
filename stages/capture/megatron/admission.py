"""Reading the capture admission that rides in Megatron's ``offload_params``, for both hooks.

The driver's ``ng_capture`` admission reaches the prompt preparer before the engine
step and the payload stager after it, each time as plain ``offload_params``. Both hooks
parse it the same way, and the preparer adds the staging key under ``CAPTURE_KEY_FIELD``
so that the stager finds the call it prepared; those shared names live here, so neither
hook imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from topics.records import CaptureAdmission

CAPTURE_KEY_FIELD = "ng_capture_key"
"""Added to ``offload_params`` by the preparer: the staging key the stager looks up."""

NO_PREFIX_IDS: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
"""The prefix of a call prepared without one (a root call, or one whose capture already failed)."""


def parse_admission(raw: Any) -> CaptureAdmission:
    """The admission riding in ``offload_params["ng_capture"]`` (its JSON form)."""
    if isinstance(raw, CaptureAdmission):
        return raw
    if not isinstance(raw, Mapping):
        raise TypeError(f"ng_capture must be a mapping, got {type(raw).__name__}")
    return CaptureAdmission.model_validate(dict(raw), strict=False)


def admission_key(raw: Any) -> str:
    """The staging key of an admission, read without validating all of it."""
    if isinstance(raw, CaptureAdmission):
        return raw.staging_key
    if not isinstance(raw, Mapping):
        raise TypeError(f"ng_capture must be a mapping, got {type(raw).__name__}")
    rollout_id, call_id = raw["rollout_id"], raw["call_id"]
    if not isinstance(rollout_id, str) or not isinstance(call_id, str):
        raise TypeError("ng_capture: rollout_id and call_id must be strings")
    return f"{rollout_id}/{call_id}"


__all__ = ["CAPTURE_KEY_FIELD", "NO_PREFIX_IDS", "admission_key", "parse_admission"]
