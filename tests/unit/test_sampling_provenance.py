"""Sampling provenance: what is recorded, from vLLM's own parameters, and how it travels."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from pipeline.dataplane.documents import sample_meta, sample_record
from pipeline.samples.archive import record_sample
from pipeline.samples.archive import sample_record as archive_record
from pipeline.samples.export import export_row, write_jsonl, write_parquet
from pipeline.trainer.shapes import skyrl_generator_output, verl_agent_loop_output
from stages.capture.vllm.provenance import provenance_of_params
from topics import canonical, digest
from topics.records import TrainingSample
from topics.sampling import SamplingProvenance, provenance_of

TRUNCATED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_only_options_that_are_not_neutral_are_written() -> None:
    assert SamplingProvenance().extras() == {}
    assert SamplingProvenance.model_validate(TRUNCATED).extras() == TRUNCATED
    canonical.extras({"sampling": SamplingProvenance.model_validate(TRUNCATED).extras()})  # encodable


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": -0.5}, "temperature"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"top_q": 0.5}, "top_q"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_a_malformed_provenance_names_its_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"extras.sampling.{field}: "):
        provenance_of({"sampling": options})


def test_vllm_parameters_are_recorded_as_the_sampler_applies_them() -> None:
    assert provenance_of_params(SamplingParams(temperature=0.7, top_p=0.8, top_k=20)).extras() == TRUNCATED
    assert provenance_of_params(SamplingParams(top_k=-1)).extras() == {}  # vLLM's "off"
    greedy = provenance_of_params(SamplingParams(temperature=0.0, top_p=0.5, top_k=5))
    assert greedy.extras() == {"temperature": 0.0}  # vLLM neutralizes the filters of greedy decoding
    assert greedy.scale == 1.0 and not greedy.truncates
    biased = provenance_of_params(SamplingParams(logit_bias={7: -2.0}, repetition_penalty=1.1, min_tokens=2))
    assert biased.extras() == {"logit_bias": {"7": -2.0}, "repetition_penalty": 1.1, "min_tokens": 2}
    assert biased.not_replayed == ["logit_bias", "min_tokens", "repetition_penalty"]
    grammar = provenance_of_params(
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    )
    assert grammar.unreplayable == ["structured_outputs"] and "unreplayable" in grammar.not_replayed


def sample_with(sampling: dict[str, object] | None) -> TrainingSample:
    ids = [1, 2, 3, 4, 5, 6]
    second = {"call_id": "c2", "start": 3, "carry_len": 1, "gen_len": 2}
    if sampling is not None:
        second["sampling"] = sampling
    return TrainingSample.model_validate(
        {
            "rollout_id": "r",
            "token_ids": ids,
            "token_mask": [0.0, 1.0, 1.0, 0.0, 1.0, 1.0],
            "logprobs": [0.0, -1.0, -1.0, 0.0, -1.0, -1.0],
            "weight_versions": [0] * 6,
            "spans": [{"call_id": "c1", "start": 0, "carry_len": 1, "gen_len": 2}, second],
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def test_the_data_plane_document_keeps_a_span_s_provenance_and_old_bytes_stay() -> None:
    plain = sample_with(None)
    assert b"sampling" not in sample_meta(plain)
    options = {**TRUNCATED, "logit_bias": {"5": 1.5}}
    sample = sample_with(options)
    back = sample_record(
        "r", sample.token_ids, sample.weight_versions, sample.token_mask, sample.logprobs, sample_meta(sample)
    )
    assert back.spans[1].sampling == sample.spans[1].sampling and back.spans[0].sampling is None


def test_exports_carry_provenance_and_read_back_in_both_formats(tmp_path: Path) -> None:
    grammar = {"temperature": 0.5, "unreplayable": ["structured_outputs"], "logit_bias": {"5": 1.5}}
    samples = [sample_with(None), sample_with(TRUNCATED), sample_with(grammar)]
    records = [archive_record(sample, "run") for sample in samples]
    assert "sampling" not in records[0]["spans"][1] and records[1]["spans"][1]["sampling"] == TRUNCATED
    stream = io.BytesIO()
    write_jsonl(records, stream)
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["unreplayable"] for line in lines] == [False, False, True]
    assert lines[1]["spans"][1]["sampling"] == TRUNCATED and lines[0]["spans"][1]["sampling"] is None
    write_parquet(records, tmp_path / "s.parquet")
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "s.parquet").to_pylist()
    for row, sample in zip(rows, samples, strict=True):
        assert record_sample(row) == sample
    assert [row["unreplayable"] for row in rows] == [False, False, True]
    assert record_sample(export_row(records[2])).unreplayable


def test_other_trainers_shapes_say_where_each_call_s_options_apply() -> None:
    sample = sample_with(TRUNCATED)
    verl = verl_agent_loop_output(sample)["extra_fields"]["response_sampling"]
    assert verl == [
        {"response_start": 0, "gen_len": 2, "sampling": {}},
        {"response_start": 3, "gen_len": 2, "sampling": TRUNCATED},
    ]
    assert skyrl_generator_output([sample])["response_sampling"] == [verl]
