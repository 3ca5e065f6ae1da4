"""Reading a finished Megatron request: ids, logprobs and policy epochs, validated.

The payload stager receives whatever the engine hands it: Megatron-LM main passes an
``OffloadedRequestPayload`` (``prompt_token_ids``, ``generated_token_ids``,
``generated_log_probs``) plus a ``FinishedRequestRecord`` carrying ``policy_epoch``;
megatron-core 0.19.2 has neither class, only ``DynamicInferenceRequest`` (``prompt_tokens``
tensor, ``generated_tokens``, ``generated_log_probs``, ``policy_epoch``) and the
``DynamicInferenceRequestRecord`` of its eviction checkpoints. All of them are read here,
by attribute or mapping key, without importing torch or Megatron.

Nothing is defaulted. A float or bool where a token id belongs, a NaN logprob, lists of
different lengths or a missing ``policy_epoch`` each raise ``InvalidPayload`` with its own
``PayloadDefect``; the call's capture then fails as ``invalid_delta`` (the DESIGN §6
code) instead of producing a row that looks right and is not. In particular a missing
epoch never becomes weight version 0.

Megatron's ``policy_epoch`` is a sparse list of ``(start_position, epoch)`` boundaries in
absolute sequence positions (prompt and generation together): the engine stamps
``(0, epoch)`` when a request is added and ``(len(prompt) + len(generated) - 1, new)``
on every active request when a new generation epoch is set. A boundary at position
``p`` means the forward pass over position ``p`` ran on the new weights, so the token
sampled from it, at generated offset ``p + 1 - len(prompt)``, is the first of the new
epoch. ``generation_versions`` turns that into the ``[[generated_offset, version], ...]``
spans of ``topics.records.EXTRAS_WEIGHT_SPANS``.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from stages.capture.errors import CaptureFailure
from topics.failures import WorkerFailure
from topics.sampling import SamplingProvenance

IdArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
EpochBoundary = tuple[int, int]

PROMPT_FIELDS = ("prompt_token_ids", "prompt_tokens")
GENERATED_FIELDS = ("generated_token_ids", "generated_tokens")
LOGPROB_FIELDS = ("generated_log_probs",)
EPOCH_FIELD = "policy_epoch"


class PayloadDefect(StrEnum):
    """What exactly is wrong with a payload; the wire code is always ``invalid_delta``."""

    MALFORMED_PAYLOAD = "malformed_payload"  # not a payload shape this reader knows
    MISSING_PROMPT = "missing_prompt"
    INVALID_IDS = "invalid_ids"  # floats, bools, negative or non-integer token ids
    MISSING_LOGPROBS = "missing_logprobs"  # the request ran without return_log_probs
    INVALID_LOGPROBS = "invalid_logprobs"  # NaN, Inf or non-numbers
    LENGTH_MISMATCH = "length_mismatch"  # logprobs and generated ids disagree
    EMPTY_GENERATION = "empty_generation"
    MISSING_POLICY_EPOCH = "missing_policy_epoch"
    MALFORMED_POLICY_EPOCH = "malformed_policy_epoch"


class InvalidPayload(CaptureFailure):
    """The payload cannot be captured; ``defect`` says why, ``code`` is ``invalid_delta``."""

    def __init__(self, defect: PayloadDefect, detail: str) -> None:
        super().__init__(WorkerFailure.INVALID_DELTA, f"{defect.value}: {detail}")
        self.defect = defect


@dataclass(frozen=True, slots=True)
class FinishedCall:
    """One finished request as plain arrays, checked, with its epoch boundaries."""

    prompt_ids: IdArray
    generated_ids: IdArray
    generated_logprobs: FloatArray
    policy_epoch: tuple[EpochBoundary, ...]


@dataclass(frozen=True, slots=True)
class GenerationVersions:
    """The admission epoch (the call's weight version) and spans when a refit landed mid-call."""

    weight_version: int
    spans: list[list[int]] | None

    @property
    def straddles_refit(self) -> bool:
        return self.spans is not None


def read_finished_call(payload: Any, finished_metadata: Any = None) -> FinishedCall:
    """Extract and validate a finished call; raises ``InvalidPayload``.

    ``policy_epoch`` comes from ``finished_metadata`` when the engine passes one (Megatron-LM
    main), else from the payload itself (a 0.19.2 request or record).
    """
    requests = _get(payload, "requests")
    if requests is not None:
        prompt, generated, logprobs, epoch = _read_record(requests)
    else:
        prompt = _first(payload, PROMPT_FIELDS)
        generated = _first(payload, GENERATED_FIELDS)
        logprobs = _first(payload, LOGPROB_FIELDS)
        epoch = _get(payload, EPOCH_FIELD)
    if finished_metadata is not None:
        epoch = _get(finished_metadata, EPOCH_FIELD)
    if prompt is None:
        raise InvalidPayload(PayloadDefect.MISSING_PROMPT, "the payload has no prompt token ids")
    if generated is None:
        raise InvalidPayload(PayloadDefect.MALFORMED_PAYLOAD, "the payload has no generated token ids")
    prompt_ids = token_ids(prompt, "prompt_token_ids")
    generated_ids = token_ids(generated, "generated_token_ids")
    if generated_ids.size == 0:
        raise InvalidPayload(PayloadDefect.EMPTY_GENERATION, "no generated tokens")
    if logprobs is None:
        raise InvalidPayload(
            PayloadDefect.MISSING_LOGPROBS, "no generated_log_probs (run with return_log_probs=True)"
        )
    generated_logprobs = finite_floats(logprobs, "generated_log_probs")
    if generated_logprobs.size != generated_ids.size:
        raise InvalidPayload(
            PayloadDefect.LENGTH_MISMATCH,
            f"{generated_logprobs.size} logprobs for {generated_ids.size} generated ids",
        )
    return FinishedCall(prompt_ids, generated_ids, generated_logprobs, epoch_boundaries(epoch))


SAMPLING_FIELD = "sampling_params"


def sampling_extras(payload: Any, finished_metadata: Any = None) -> dict[str, Any] | None:
    """The non-neutral sampling options of a finished request (DESIGN §4.7; {} when all are
    neutral), None when the engine hands over none.

    Megatron's processed log probs are of the logits divided by the temperature, then
    top-k and top-p, the options its ``SamplingParams`` carry (``top_p`` 0 and ``top_k`` 0
    are off). A 0.19.2 request and its record carry them; Megatron-LM main's offloaded
    payload does not, unless its metadata does, and such a call is then counted as of
    unknown provenance by the trainers."""
    requests = _get(payload, "requests")
    source = requests[0] if isinstance(requests, list | tuple) and requests else payload
    params = _get(source, SAMPLING_FIELD)
    if params is None and finished_metadata is not None:
        params = _get(finished_metadata, SAMPLING_FIELD)
    if params is None:
        return None
    top_p = float(_get(params, "top_p") or 0.0)
    options = {
        "temperature": float(_get(params, "temperature") or 1.0),
        "top_k": max(int(_get(params, "top_k") or 0), 0),
        "top_p": top_p if 0.0 < top_p < 1.0 else 1.0,
    }
    try:
        return SamplingProvenance.model_validate(options).extras()
    except ValidationError as exc:
        raise InvalidPayload(
            PayloadDefect.MALFORMED_PAYLOAD, f"{SAMPLING_FIELD}: {exc.errors()[0]['msg']}"
        ) from None


def token_ids(value: Any, field: str) -> IdArray:
    """Token ids as int64; lists must hold ints (numpy integers allowed), never bools or floats.

    Lists are converted by ``array.array("q")``, which refuses floats (Python or numpy) in
    C; it takes bools as 0 and 1, so only elements that came out as 0 or 1 are looked at
    again for their type. That keeps the check exact at the cost of the conversion alone.
    """
    if _is_tensor(value):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise InvalidPayload(PayloadDefect.INVALID_IDS, f"{field}: an array of {value.dtype} ids")
        if value.dtype.kind == "u" and value.size and int(value.max()) >= 2**63:
            raise InvalidPayload(PayloadDefect.INVALID_IDS, f"{field}: an id does not fit in int64")
        ids = value.astype(np.int64, copy=False)
    elif isinstance(value, list | tuple):
        try:
            ids = np.frombuffer(array.array("q", value), dtype=np.int64)
        except (TypeError, OverflowError) as exc:
            raise InvalidPayload(PayloadDefect.INVALID_IDS, f"{field}: {exc}") from None
        _refuse_bools(value, ids <= 1, PayloadDefect.INVALID_IDS, field)
    else:
        raise InvalidPayload(
            PayloadDefect.INVALID_IDS, f"{field}: a {type(value).__name__}, not a list of ids"
        )
    if ids.size and int(ids.min()) < 0:
        raise InvalidPayload(PayloadDefect.INVALID_IDS, f"{field}: negative token id")
    return ids


def finite_floats(value: Any, field: str) -> FloatArray:
    """Finite float64 values; bools, strings and None are refused, not coerced."""
    if _is_tensor(value):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "fiu":
            raise InvalidPayload(PayloadDefect.INVALID_LOGPROBS, f"{field}: an array of {value.dtype}")
        floats = value.astype(np.float64, copy=False)
    elif isinstance(value, list | tuple):
        try:  # refuses strings and None; takes bools as 0.0 and 1.0, looked at below
            floats = np.frombuffer(array.array("d", value), dtype=np.float64)
        except (TypeError, OverflowError) as exc:
            raise InvalidPayload(PayloadDefect.INVALID_LOGPROBS, f"{field}: {exc}") from None
        _refuse_bools(value, (floats == 0.0) | (floats == 1.0), PayloadDefect.INVALID_LOGPROBS, field)
    else:
        raise InvalidPayload(PayloadDefect.INVALID_LOGPROBS, f"{field}: a {type(value).__name__}")
    if floats.size and not np.isfinite(floats).all():
        raise InvalidPayload(PayloadDefect.INVALID_LOGPROBS, f"{field}: NaN or Inf")
    return floats


def epoch_boundaries(value: Any) -> tuple[EpochBoundary, ...]:
    """Megatron's ``[(start_position, epoch), ...]``, checked: never defaulted."""
    if value is None:
        raise InvalidPayload(
            PayloadDefect.MISSING_POLICY_EPOCH,
            "policy_epoch is None: the engine had no generation epoch set, so the weight version is unknown",
        )
    if not isinstance(value, list | tuple) or not value:
        raise InvalidPayload(PayloadDefect.MALFORMED_POLICY_EPOCH, f"policy_epoch: {value!r}")
    boundaries: list[EpochBoundary] = []
    for item in value:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or any(type(part) is not int or part < 0 for part in item)
        ):
            raise InvalidPayload(
                PayloadDefect.MALFORMED_POLICY_EPOCH, f"policy_epoch: {item!r} is not a pair of ints >= 0"
            )
        if boundaries and item[0] < boundaries[-1][0]:
            raise InvalidPayload(PayloadDefect.MALFORMED_POLICY_EPOCH, "policy_epoch: positions go back")
        boundaries.append((item[0], item[1]))
    if boundaries[0][0] != 0:
        raise InvalidPayload(
            PayloadDefect.MALFORMED_POLICY_EPOCH, "policy_epoch: the first boundary is not at position 0"
        )
    return tuple(boundaries)


def generation_versions(
    boundaries: Sequence[EpochBoundary], prompt_len: int, generated_len: int
) -> GenerationVersions:
    """The admission epoch, and ``[[offset, version], ...]`` if any token came from other weights.

    Boundaries that take effect at the same generated offset keep the last one (an epoch
    set twice before a token was sampled); those past the last token, and repeats of the
    current version, are dropped.
    """
    admission = boundaries[0][1]
    spans: list[list[int]] = []
    for position, epoch in boundaries:
        offset = max(0, position + 1 - prompt_len)
        if offset >= generated_len:
            break
        if spans and spans[-1][0] == offset:
            spans.pop()
        if spans and spans[-1][1] == epoch:
            continue
        spans.append([offset, epoch])
    if spans == [[0, admission]]:
        return GenerationVersions(admission, None)
    return GenerationVersions(admission, spans)


def _read_record(requests: Any) -> tuple[Any, Any, Any, Any]:
    """A 0.19.2 ``DynamicInferenceRequestRecord``: merged the way its ``merge()`` does.

    Its first segment holds the original prompt; every checkpoint (eviction) starts a new
    segment whose generated tokens and logprobs continue the previous ones; the last
    segment carries the epoch boundaries, in absolute positions.
    """
    if not isinstance(requests, list | tuple) or not requests:
        raise InvalidPayload(PayloadDefect.MALFORMED_PAYLOAD, "a request record without requests")
    generated: list[Any] = []
    logprobs: list[Any] | None = []
    for segment in requests:
        part = _first(segment, GENERATED_FIELDS)
        if part is None:
            raise InvalidPayload(PayloadDefect.MALFORMED_PAYLOAD, "a record segment has no generated tokens")
        generated.extend(_as_list(part))
        segment_logprobs = _first(segment, LOGPROB_FIELDS)
        if segment_logprobs is None:
            logprobs = None
        elif logprobs is not None:
            logprobs.extend(_as_list(segment_logprobs))
    first, last = requests[0], requests[-1]
    return _first(first, PROMPT_FIELDS), generated, logprobs, _get(last, EPOCH_FIELD)


def _get(source: Any, name: str) -> Any:
    if type(source) is dict or isinstance(source, Mapping):  # a dict skips the ABC check
        return source.get(name)
    return getattr(source, name, None)


def _first(source: Any, names: Sequence[str]) -> Any:
    for name in names:
        value = _get(source, name)
        if value is not None:
            return value
    return None


def _as_list(value: Any) -> list[Any]:
    if _is_tensor(value):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        converted: list[Any] = value.tolist()
        return converted
    return list(value)


def _is_tensor(value: Any) -> bool:
    """A torch tensor, recognised without importing torch."""
    return hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy")


def _refuse_bools(
    values: Sequence[Any], suspects: npt.NDArray[np.bool_], defect: PayloadDefect, field: str
) -> None:
    """A bool converts to 0 or 1: only the elements that did are checked for their type."""
    for index in np.flatnonzero(suspects):
        if isinstance(values[index], bool | np.bool_):
            raise InvalidPayload(defect, f"{field}: a bool at position {index}")


__all__ = [
    "FinishedCall",
    "GenerationVersions",
    "InvalidPayload",
    "PayloadDefect",
    "epoch_boundaries",
    "finite_floats",
    "generation_versions",
    "read_finished_call",
    "token_ids",
]
