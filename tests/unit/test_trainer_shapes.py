"""Samples in other trainers' shapes: verl's agent-loop output, SkyRL's generator output,
and Hugging Face ``datasets`` over the Parquet export."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset
from rowkit import FIRST, PROMPT, SECOND, TOOL, two_calls

from pipeline.samples.archive import record_sample, sample_record
from pipeline.samples.export import write_parquet
from pipeline.trainer.shapes import skyrl_generator_output, split, verl_agent_loop_output


def test_the_prompt_is_the_first_call_and_tool_tokens_are_masked_in_the_response() -> None:
    sample = two_calls("r1", 0.5)
    part = split(sample)
    assert part.prompt_ids == PROMPT and part.prompt_ids + part.response_ids == sample.token_ids
    assert part.response_mask == [1, 1, 0, 0, 1, 1]
    assert part.response_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4]
    verl = verl_agent_loop_output(sample)
    assert (verl["prompt_ids"], verl["response_ids"]) == (PROMPT, FIRST + TOOL + SECOND)
    assert verl["response_mask"] == part.response_mask and verl["reward_score"] == 0.5
    assert verl["num_turns"] == 4 and verl["extra_fields"]["weight_versions"] == [0, 0, 0, 0, 1, 1]


def test_a_skyrl_batch_has_one_entry_per_sample_in_order() -> None:
    batch = skyrl_generator_output([two_calls("r1", 1.0), two_calls("r2", None)])
    assert batch["prompt_token_ids"] == [PROMPT, PROMPT]
    assert batch["loss_masks"] == [[1, 1, 0, 0, 1, 1]] * 2
    assert batch["rewards"] == [1.0, 0.0]
    assert len(batch["rollout_logprobs"][0]) == len(batch["response_ids"][0]) == 6


def test_datasets_reads_the_parquet_export_back_into_samples(tmp_path: Path) -> None:
    samples = [two_calls("r1", 1.0), two_calls("r2", None)]
    path = tmp_path / "samples.parquet"
    write_parquet([sample_record(s, "run-1") for s in samples], path)
    dataset = Dataset.from_parquet(str(path))
    assert dataset.num_rows == 2 and dataset[0]["run_id"] == "run-1"
    assert [record_sample(row) for row in dataset] == samples
