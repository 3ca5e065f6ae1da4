"""The worker's own HTTP shapes: the capture field and the admin bodies.

Requests are validated before anything reaches vLLM or capture, so a bad field is a 400
that names it and never a half-captured call.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.api.errors import InvalidRequest, invalid_request
from topics.choices import check_shared_prefix, choice_admissions
from topics.records import CaptureAdmission
from topics.wire import CAPTURE_FIELD


def capture_admissions(raw: Any, n: int) -> list[CaptureAdmission]:
    """The admitted call of each of the ``n`` choices (``topics.choices``), or [] when not captured.

    ``raw`` is one admission (choices ``{call_id}.{i}`` when ``n`` > 1) or a list of ``n``
    admissions on one prefix.
    """
    if raw is None:
        return []
    if isinstance(raw, list):
        if len(raw) != n:
            raise InvalidRequest(CAPTURE_FIELD, f"{CAPTURE_FIELD}: {len(raw)} admissions for n={n}")
        admissions = [_admission(item, f"{CAPTURE_FIELD}[{i}]") for i, item in enumerate(raw)]
    else:
        admissions = choice_admissions(_admission(raw, CAPTURE_FIELD), n)
    try:
        check_shared_prefix(admissions)
    except ValueError as exc:
        raise InvalidRequest(CAPTURE_FIELD, f"{CAPTURE_FIELD}{exc}") from None
    return admissions


def _admission(raw: Any, root: str) -> CaptureAdmission:
    try:
        return CaptureAdmission.model_validate(raw)
    except ValidationError as exc:
        raise invalid_request(exc, root) from None


class ReloadWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)


class SetWeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: int = Field(ge=0)
