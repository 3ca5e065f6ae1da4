"""TRL's own GRPO trainer on samples whose calls used their own sampling: its loss and its
importance ratio replay each call's temperature, top-k and top-p against the captured
logprobs (on policy 1 on every token; mislabelled or in bf16 not), unreplayable calls are
masked, and a misaligned sample fails by its key.

The samples are drawn in process from the tiny model with vLLM's own filtering op (not the
replay under test), as the engine draws them; the engine's own samples are the end-to-end
tests' (``tests/integration/test_run_e2e.py``)."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from pipeline.models.tiny import make_tiny_model
from pipeline.trainer.recompute import measure
from pipeline.trainer.steplog import StepWriter, read_steps
from pipeline.trainer.trl import REWARD_FIELD, TrlBridge, grpo_trainer, rollout_fields
from pipeline.trainer.trl_fields import SAMPLE_KEY_FIELD, SAMPLING_FIELD, aligned
from stages.finalize.reader import FinalizedRollout, Group
from stages.trainer.batch import TrainBatch, audit_batch, build_batch
from stages.trainer.staleness import StalenessPolicy
from topics import digest
from topics.records import FinalizedEvent, TrainingSample
from topics.sampling import SamplingProvenance

TRUNCATED = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
PLAIN_HOT = {"temperature": 1.3}
PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "And 5 + 1?"}]]
GROUP = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def draw(
    model: Any, ids: list[int], n: int, options: dict[str, Any], seed: int
) -> tuple[list[int], list[float]]:
    """``n`` tokens after ``ids`` from the processed distribution, as vLLM's sampler draws
    them, with their processed logprobs."""
    generator = torch.Generator().manual_seed(seed)
    tokens, logprobs = [], []
    k = torch.tensor([options["top_k"]]) if "top_k" in options else None
    p = torch.tensor([options["top_p"]]) if "top_p" in options else None
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids + tokens])).logits[:, -1].float()
            processed = apply_top_k_top_p_pytorch(logits / options["temperature"], k, p).log_softmax(-1)
            token = int(torch.multinomial(processed.exp(), 1, generator=generator))
            tokens.append(token)
            logprobs.append(float(processed[0, token]))
    return tokens, logprobs


def two_call_sample(
    model: Any,
    tokenizer: Any,
    prompt: list[dict[str, str]],
    key: str,
    seed: int,
    *,
    label: dict[str, Any] | None = None,
) -> TrainingSample:
    """A call at T 0.7, top-k 20, top-p 0.8, a tool result, a second call at T 1.3 unfiltered;
    ``label`` records other options on the first call than it used."""
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    first, first_lps = draw(model, head, 6, TRUNCATED, seed)
    tool = tokenizer.encode("\n7\n", add_special_tokens=False)
    second, second_lps = draw(model, head + first + tool, 5, PLAIN_HOT, seed + 1)
    ids = head + first + tool + second
    return TrainingSample.model_validate(
        {
            "rollout_id": key,
            "group_id": "g",
            "token_ids": ids,
            "token_mask": [0.0] * len(head) + [1.0] * 6 + [0.0] * len(tool) + [1.0] * 5,
            "logprobs": [0.0] * len(head) + first_lps + [0.0] * len(tool) + second_lps,
            "weight_versions": [0] * len(ids),
            "spans": [
                {
                    "call_id": "c1",
                    "start": 0,
                    "carry_len": len(head),
                    "gen_len": 6,
                    "sampling": label or TRUNCATED,
                },
                {
                    "call_id": "c2",
                    "start": len(head) + 6,
                    "carry_len": len(tool),
                    "gen_len": 5,
                    "sampling": PLAIN_HOT,
                },
            ],
            "reward": float(seed % 3),
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def groups_of(model_dir: Path, *, label: dict[str, Any] | None = None) -> list[list[TrainingSample | None]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [
        [
            two_call_sample(model, tokenizer, prompt, f"r{g}{m}", seed=10 * g + m, label=label)
            for m in range(GROUP)
        ]
        for g, prompt in enumerate(PROMPTS)
    ]


class Logs(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def trainer_on(
    model_dir: Path, tmp_path: Path, groups: list[list[TrainingSample | None]], **settings: Any
) -> tuple[Any, Logs]:
    logs = Logs()
    trainer = grpo_trainer(
        model_dir,
        [prompt for prompt in PROMPTS],
        rollout_func=lambda prompts, trainer: rollout_fields(groups).fields,
        serving=lambda: 0,
        callbacks=[logs],
        group_size=GROUP,
        groups_per_step=len(PROMPTS),
        steps=1,
        learning_rate=1e-3,
        output_dir=tmp_path / "trl",
        seed=0,
        **settings,
    )
    return trainer, logs


def test_on_policy_trls_own_ratio_is_one_on_every_token(model_dir: Path, tmp_path: Path) -> None:
    trainer, logs = trainer_on(model_dir, tmp_path, groups_of(model_dir))
    trainer.train()
    (logged,) = logs.logs
    assert abs(logged["sampling/importance_sampling_ratio/min"] - 1) < 1e-4
    assert abs(logged["sampling/importance_sampling_ratio/max"] - 1) < 1e-4
    assert logged["sampling/sampling_logp_difference/max"] < 1e-4
    assert logged["clip_ratio/region_mean"] == 0.0  # the loss's own ratio is 1 too
    assert logged["entropy"] > 0


def test_a_call_recorded_with_other_options_than_it_used_moves_trls_ratio(
    model_dir: Path, tmp_path: Path
) -> None:
    """The same draws labelled as untruncated at T 1 (what a trainer ignoring provenance
    computes): TRL's ratio is then off by the kept mass and the temperature."""
    trainer, logs = trainer_on(model_dir, tmp_path, groups_of(model_dir, label={"temperature": 1.0}))
    trainer.train()
    (logged,) = logs.logs
    assert logged["sampling/sampling_logp_difference/max"] > 0.05


def test_bf16_trl_ratio_and_tokentrails_report_name_the_same_worst_token(
    model_dir: Path, tmp_path: Path
) -> None:
    groups = groups_of(model_dir)
    trainer, _ = trainer_on(model_dir, tmp_path, groups, dtype="bfloat16")
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(GROUP)])
    mask = (output["completion_mask"] * output["tool_mask"]).bool()
    delta = (output["old_per_token_logps"] - output["sampling_per_token_logps"]).abs().masked_fill(~mask, 0)
    assert float(delta.max()) > 1e-3  # bf16 against the fp32 draws: a real mismatch
    metrics = trainer._metrics["train"]
    assert abs(metrics["sampling/importance_sampling_ratio/max"][-1] - 1) > 1e-3
    samples = [s for group in groups for s in group if s is not None]
    row, column = divmod(int(delta.argmax()), delta.size(1))
    prompt_len = len(samples[row].token_ids) - int(output["completion_mask"][row].sum())
    report, _ = measure(trainer.model, audit_batch(samples), policy_version=0)
    worst = {(w["sample_key"], w["position"]) for w in report["worst"]}
    assert (samples[row].key, prompt_len + column) in worst
    assert abs(report["max_abs_log_ratio"] - float(delta.max())) < 1e-2


def test_an_unreplayable_call_is_masked_from_trls_loss_and_counted(model_dir: Path) -> None:
    groups = groups_of(model_dir)
    sample = groups[0][0]
    assert sample is not None
    grammar = SamplingProvenance(temperature=1.3, unreplayable=["structured_outputs"])
    spans = [sample.spans[0], sample.spans[1].model_copy(update={"sampling": grammar})]
    groups[0][0] = sample.model_copy(update={"spans": spans})
    rollouts = rollout_fields(groups)
    assert rollouts.unreplayable_masked_tokens == 5
    assert rollouts.fields["env_mask"][0][-5:] == [0] * 5 and sum(rollouts.fields["env_mask"][0]) == 6
    assert rollouts.fields[SAMPLING_FIELD][0]["temperature"][:6] == pytest.approx([0.7] * 6)
    assert rollouts.fields[SAMPLING_FIELD][0]["top_k"][:6] == [20] * 6
    assert rollouts.fields[SAMPLE_KEY_FIELD][0] == sample.key


def test_a_sample_whose_lengths_disagree_fails_by_its_key(model_dir: Path, tmp_path: Path) -> None:
    groups = groups_of(model_dir)
    fields = rollout_fields(groups).fields
    fields["logprobs"][3] = fields["logprobs"][3][:-1]
    trainer, _ = trainer_on(model_dir, tmp_path, groups)
    trainer.rollout_func = lambda prompts, trainer: fields
    with pytest.raises(ValueError, match=r"sample r11: \d+ completion tokens, but \{'logprobs'"):
        trainer.train()
    with pytest.raises(ValueError, match="rollout_func: 1 env_mask for 2 completions"):
        aligned([[1], [2]], [[0.0], [0.0]], [[1]], [{}, {}], ["a", "b"])


def rejected(rollout_id: str, group_id: str, code: str) -> FinalizedRollout:
    event = FinalizedEvent.model_validate(
        {
            "rollout_id": rollout_id,
            "group_id": group_id,
            "status": "rejected",
            "rejection_reason": code,
            "prompt_len": 0,
            "total_len": 0,
            "generated_tokens": 0,
            "call_count": 1,
            "finalized_at": 1.0,
        }
    )
    return FinalizedRollout(event)


def accepted(sample: TrainingSample, group_id: str) -> FinalizedRollout:
    event = FinalizedEvent.model_validate(
        {
            "rollout_id": sample.rollout_id,
            "group_id": group_id,
            "status": "accepted",
            "sample_key": sample.key,
            "prompt_len": 0,
            "total_len": len(sample.token_ids),
            "generated_tokens": 11,
            "call_count": 2,
            "finalized_at": 1.0,
        }
    )
    return FinalizedRollout(event, (sample,))


def test_a_group_with_every_member_rejected_is_skipped_and_named_in_the_step(
    model_dir: Path, tmp_path: Path
) -> None:
    """The bridge as a run drives it: group g1's rollouts were all rejected, so TRL gets
    placeholders for it, the step trains on g0 alone, and its report says why g1 is missing."""
    drawn = groups_of(model_dir)[0]
    assert all(s is not None for s in drawn)
    played = [
        Group("g0", [accepted(s, "g0") for s in drawn if s is not None]),
        Group("g1", [rejected("r10", "g1", "digest_mismatch"), rejected("r11", "g1", "rollout_failed")]),
    ]
    batch = build_batch(played, policy_version=0, staleness=StalenessPolicy())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def play(prompts: list[Any]) -> list[str]:
        return ["g0", "g1"]

    async def next_batch(group_ids: list[str]) -> TrainBatch:
        return batch

    async def nothing(*args: Any) -> None:
        return None

    bridge = TrlBridge(
        loop,
        play=play,
        next_batch=next_batch,
        refit=nothing,
        ack=nothing,
        version=lambda: 0,
        weights_dir=tmp_path / "weights",
        step_writer=StepWriter(tmp_path, "run-x", "trl"),
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    try:
        fields = bridge.rollout_func(
            [p for p in PROMPTS for _ in range(GROUP)], SimpleNamespace(num_generations=GROUP, model=model)
        )
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    assert fields["env_mask"][2:] == [[0], [0]] and fields[REWARD_FIELD][2:] == [0.0, 0.0]
    (step,) = bridge.steps
    assert step.skipped_groups == {
        "g1": "no accepted member: 2 rollouts rejected (digest_mismatch ×1, rollout_failed ×1)"
    }
    assert step.samples == 2 and step.mismatch is not None and step.mismatch["tokens"] == 22
    (log,), _ = read_steps(tmp_path)
    assert log.reward_mean == pytest.approx(step.reward_mean) and log.trainer_metrics == {}
    bridge.logged({"loss": 0.25, "sampling/importance_sampling_ratio/max": 1.0, "epoch": 1, "note": "x"})
    (log,), _ = read_steps(tmp_path)
    assert log.trainer_metrics == {"loss": 0.25, "sampling/importance_sampling_ratio/max": 1.0, "epoch": 1.0}
    assert log.mismatch == step.mismatch  # the report stays as written


def test_trl_trains_a_step_with_a_skipped_group_and_a_step_with_nothing_to_train(
    model_dir: Path, tmp_path: Path
) -> None:
    """TRL's own step over the placeholders: the kept group trains (ratio 1 on its tokens,
    the placeholders out of every statistic); with every group skipped the loss is 0 and no
    weight moves."""
    groups = groups_of(model_dir)
    groups[1] = [None] * GROUP
    trainer, logs = trainer_on(model_dir, tmp_path / "one", groups)
    trainer.train()
    (logged,) = logs.logs
    assert math.isfinite(logged["loss"])
    assert abs(logged["sampling/importance_sampling_ratio/min"] - 1) < 1e-4
    assert logged["sampling/sampling_logp_difference/max"] < 1e-4

    empty: list[list[TrainingSample | None]] = [[None] * GROUP for _ in PROMPTS]
    trainer, logs = trainer_on(model_dir, tmp_path / "none", empty)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (logged,) = logs.logs
    assert logged["loss"] == 0.0
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))
