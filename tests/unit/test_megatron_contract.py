"""The contract with megatron-core 0.19.2: the fields and signatures the adapter relies on.

Every assertion here names something ``stages.capture.megatron`` reads. If a Megatron
upgrade changes one of them, this file fails first and says what moved; update the
adapter's reader (``megatron_payload``) and the pins together.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib import metadata
from typing import Any, Optional

import numpy as np
import pytest
import torch
from megatron.core.inference import inference_request
from megatron.core.inference import sampling_params as sampling

from stages.capture.megatron.payload import (
    InvalidPayload,
    PayloadDefect,
    epoch_boundaries,
    finite_floats,
    generation_versions,
    read_finished_call,
    token_ids,
)

DynamicInferenceRequest = inference_request.DynamicInferenceRequest
DynamicInferenceRequestRecord = inference_request.DynamicInferenceRequestRecord
SamplingParams = sampling.SamplingParams

EPOCHS = Optional[list[tuple[int, int]]]  # noqa: UP045 - Megatron's own spelling, compared by equality


def fields_of(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_pinned_version() -> None:
    assert metadata.version("megatron-core") == "0.19.2"


def test_dynamic_inference_request_fields() -> None:
    fields = fields_of(DynamicInferenceRequest)
    assert fields["request_id"].type is int
    assert fields["prompt_tokens"].type == Optional[torch.Tensor]  # noqa: UP045
    assert fields["policy_epoch"].type == EPOCHS and fields["policy_epoch"].default is None
    assert fields["kv_cache_epoch"].type == EPOCHS and fields["kv_cache_epoch"].default is None
    # Declared as a tensor on the base class; the dynamic engine appends Python floats to a list.
    assert "generated_log_probs" in fields and fields["generated_log_probs"].default is None
    assert fields["generated_tokens"].default_factory is list
    assert fields["sampling_params"].type == Optional[SamplingParams]  # noqa: UP045
    for name in ("status", "events", "prompt_log_probs"):
        assert name in fields
    assert dataclasses.is_dataclass(DynamicInferenceRequest)
    assert all(f.kw_only for f in fields.values())  # constructed by keyword, as the adapter's tests do


def test_request_record_fields_and_methods() -> None:
    fields = fields_of(DynamicInferenceRequestRecord)
    assert set(fields) == {"requests", "latency"}
    assert list(inspect.signature(DynamicInferenceRequestRecord.from_request).parameters) == ["request"]
    assert list(inspect.signature(DynamicInferenceRequestRecord.merge).parameters) == ["self", "tokenizer"]
    assert list(inspect.signature(DynamicInferenceRequestRecord.checkpoint).parameters) == [
        "self",
        "tokenizer",
    ]


def test_sampling_params_fields() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert defaults["return_log_probs"] is False
    assert defaults["skip_prompt_log_probs"] is False
    assert defaults["num_tokens_to_generate"] is None
    assert defaults["termination_id"] is None
    assert (defaults["temperature"], defaults["top_k"], defaults["top_p"]) == (1.0, 0, 0.0)


def test_engine_stamps_epochs_as_the_adapter_reads_them() -> None:
    """Boundaries are (len(prompt) + len(generated) - 1, epoch), and (0, epoch) at admission."""
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    schedule = inspect.getsource(DynamicInferenceEngine.schedule_requests)
    assert "total = len(request.prompt_tokens) + len(request.generated_tokens)" in schedule
    assert "boundary = (total - 1, new_generation_epoch)" in schedule
    assert "request.policy_epoch = [(0, epoch)]" in inspect.getsource(DynamicInferenceEngine._add_request)
    parameters = list(inspect.signature(DynamicInferenceEngine.add_request).parameters)
    assert parameters == ["self", "request_id", "prompt", "sampling_params"]


def test_this_version_has_no_capture_hooks() -> None:
    """0.19.2 predates PR 7015; when this fails, the hooks have arrived: install them for real."""
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    source = inspect.getsource(DynamicInferenceEngine)
    assert "payload_stager" not in source and "prompt_preparer" not in source


def _request(prompt: list[int], epoch: int | None = 4) -> Any:
    request = DynamicInferenceRequest(
        request_id=7,
        prompt_tokens=torch.tensor(prompt, dtype=torch.int64),
        sampling_params=SamplingParams(return_log_probs=True, num_tokens_to_generate=8),
    )
    if epoch is not None:
        request.policy_epoch = [(0, epoch)]
    return request


def test_reads_a_real_request_and_an_evicted_record() -> None:
    request = _request([11, 12, 13])
    request.generated_tokens += [21, 22]
    request.generated_log_probs = [-0.5, -0.25]
    call = read_finished_call(request)
    assert call.prompt_ids.tolist() == [11, 12, 13] and call.generated_ids.tolist() == [21, 22]
    assert call.generated_logprobs.tolist() == [-0.5, -0.25] and call.policy_epoch == ((0, 4),)

    record = DynamicInferenceRequestRecord.from_request(request)
    record.checkpoint()  # eviction: the next segment's prompt is prompt + generated
    assert record[-1].prompt_tokens.tolist() == [11, 12, 13, 21, 22]
    record[-1].policy_epoch.append((4, 5))  # a refit stamped after the eviction
    record[-1].generated_tokens += [23]
    record[-1].generated_log_probs = [-1.0]
    call = read_finished_call(record)
    assert call.prompt_ids.tolist() == [11, 12, 13] and call.generated_ids.tolist() == [21, 22, 23]
    assert call.generated_logprobs.tolist() == [-0.5, -0.25, -1.0]
    merged = record.merge()  # the same view Megatron's own merge gives
    assert list(merged.generated_tokens) == [21, 22, 23] and merged.policy_epoch == [(0, 4), (4, 5)]
    assert generation_versions(call.policy_epoch, 3, 3).spans == [[0, 4], [2, 5]]


def test_a_request_from_an_engine_without_an_epoch_has_none_and_is_refused() -> None:
    request = _request([1, 2], epoch=None)
    request.generated_tokens += [3]
    request.generated_log_probs = [-0.1]
    assert request.policy_epoch is None
    with pytest.raises(InvalidPayload) as caught:
        read_finished_call(request)
    assert caught.value.defect is PayloadDefect.MISSING_POLICY_EPOCH
    assert caught.value.code == "invalid_delta"


@pytest.mark.parametrize(
    "boundaries, prompt_len, generated, version, spans",
    [
        ([(0, 3)], 5, 4, 3, None),
        ([(0, 3), (6, 4)], 5, 4, 3, [[0, 3], [2, 4]]),  # stamped with 2 tokens out
        ([(0, 3), (4, 4)], 5, 4, 3, [[0, 4]]),  # refit before the first token
        ([(0, 3), (4, 4), (4, 5)], 5, 4, 3, [[0, 5]]),  # two refits before it: the last wins
        ([(0, 3), (8, 4)], 5, 4, 3, None),  # after the last token: no token under it
        ([(0, 3), (6, 4), (7, 3)], 5, 4, 3, [[0, 3], [2, 4], [3, 3]]),
        ([(0, 3), (6, 3)], 5, 4, 3, None),  # same version again
    ],
)
def test_generation_versions(
    boundaries: list[tuple[int, int]], prompt_len: int, generated: int, version: int, spans: Any
) -> None:
    result = generation_versions(boundaries, prompt_len, generated)
    assert (result.weight_version, result.spans) == (version, spans)


@pytest.mark.parametrize(
    "value, defect",
    [
        (None, PayloadDefect.MISSING_POLICY_EPOCH),
        ([], PayloadDefect.MALFORMED_POLICY_EPOCH),
        ([(1, 3)], PayloadDefect.MALFORMED_POLICY_EPOCH),
        ([(0, -1)], PayloadDefect.MALFORMED_POLICY_EPOCH),
        ([(0, True)], PayloadDefect.MALFORMED_POLICY_EPOCH),
        ([(0, 3), (5, 4), (2, 5)], PayloadDefect.MALFORMED_POLICY_EPOCH),
        ([(0, 3, 1)], PayloadDefect.MALFORMED_POLICY_EPOCH),
        ("0:3", PayloadDefect.MALFORMED_POLICY_EPOCH),
    ],
)
def test_epoch_boundaries_are_never_defaulted(value: Any, defect: PayloadDefect) -> None:
    with pytest.raises(InvalidPayload) as caught:
        epoch_boundaries(value)
    assert caught.value.defect is defect


@pytest.mark.parametrize(
    "ids, ok",
    [
        ([1, 2, 3], True),
        ([np.int64(1), np.int32(0), 7], True),  # numpy integers are integers
        ([1, True, 3], False),
        ([0, 2, False], False),
        ([1, np.True_], False),
        ([1.0, 2, 3], False),
        ([1, np.float64(2.0)], False),
        ([1, "2"], False),
        ([1, None], False),
        ([1, -2], False),
        ([2**63], False),
        (np.array([1.0, 2.0]), False),
        (np.array([True, False]), False),
        (np.array([1, 2], dtype=np.uint64), True),
    ],
)
def test_token_ids_are_integers_only(ids: Any, ok: bool) -> None:
    if ok:
        assert token_ids(ids, "ids").tolist() == [int(i) for i in ids]
    else:
        with pytest.raises(InvalidPayload) as caught:
            token_ids(ids, "ids")
        assert caught.value.defect is PayloadDefect.INVALID_IDS


@pytest.mark.parametrize(
    "values, ok",
    [
        ([-0.5, 0.0, -1e-9], True),
        ([np.float32(-0.5), -2, np.float64(-1.0)], True),
        ([-0.5, float("nan")], False),
        ([float("-inf")], False),
        ([False, -0.5], False),
        ([-0.5, "-0.5"], False),
        ([None], False),
        (np.array([-0.5, np.inf]), False),
    ],
)
def test_logprobs_are_finite_numbers_only(values: Any, ok: bool) -> None:
    if ok:
        assert finite_floats(values, "lp").tolist() == [float(v) for v in values]
    else:
        with pytest.raises(InvalidPayload) as caught:
            finite_floats(values, "lp")
        assert caught.value.defect is PayloadDefect.INVALID_LOGPROBS
