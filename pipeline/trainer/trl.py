"""TRL's ``GRPOTrainer`` trains on tokentrail's verified samples.

TRL asks its ``rollout_func`` for completions of a batch of prompts; here each distinct
prompt is a task whose GRPO group tokentrail plays (driver, worker, capture, stages), and
what comes back are the verified samples, cut the way ``pipeline.trainer.shapes`` cuts
them: ``prompt_ids``, ``completion_ids``, the captured ``logprobs``, an ``env_mask`` that
is 0 on tool and user tokens, and the environment's reward as an extra field that
``environment_reward`` hands to TRL. After each optimizer step the callback saves TRL's
weights and refits the worker, so the next samples carry the next weight version; only
then are the step's samples acknowledged (deleted from the data plane, offsets committed).

TRL's ``rollout_func`` and callbacks run in TRL's training thread; the pipeline's work
runs on the run's event loop, reached with ``asyncio.run_coroutine_threadsafe``.

A member of a group with no accepted sample (rejected) still needs a completion, since
TRL normalizes rewards over ``num_generations`` completions per prompt: it is given an
accepted sibling's tokens with an ``env_mask`` of zeros (no gradient) and the mean reward of
the accepted members (the group's mean unchanged, its advantage 0), and counted. A group
with no accepted member at all (every rollout rejected) is skipped: TRL still gets its
``num_generations`` completions, each a one-token placeholder with an ``env_mask`` of 0
and the same reward (advantage 0, nothing trained), and the step's report names the group
and the rejections that emptied it (``TrlStep.skipped_groups``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.trainer.recompute import measure
from pipeline.trainer.shapes import split
from pipeline.trainer.steplog import StepWriter
from pipeline.trainer.trl_fields import OPTIONS, SAMPLE_KEY_FIELD, SAMPLING_FIELD
from stages.finalize.reader import FinalizedRollout
from stages.trainer.batch import TokenLayout, TrainBatch, span_end_rewards, unreplayable_spans
from stages.trainer.settings import TrainerDtype
from topics.records import TrainingSample

log = logging.getLogger(__name__)

REWARD_FIELD = "tokentrail_reward"
"""The extra field of ``rollout_func``'s output that carries each completion's reward."""
CALL_REWARDS_FIELD = "tokentrail_call_rewards"
"""The extra field with each completion's per-token call rewards (``TrainBatch.call_rewards``,
aligned with ``completion_ids``), for reward functions that score turns."""
PLACEHOLDER_TOKEN = 0
"""The token of a skipped group's placeholder completions: every vocabulary has id 0, and
the completion is masked, so which token it is never matters."""
T = TypeVar("T")
Messages = list[dict[str, Any]]


def environment_reward(
    prompts: Sequence[Any], completions: Sequence[Any], **fields: Any
) -> list[float | None]:
    """A TRL reward function: the reward the environment sealed each rollout with."""
    rewards: list[float | None] = fields[REWARD_FIELD]
    return rewards


@dataclass(frozen=True, slots=True)
class Rollouts:
    """TRL's ``rollout_func`` output for groups of samples, and what was done to fit them."""

    fields: dict[str, list[Any]]
    filled: int
    """Rejected members filled in with a sibling's tokens (see the module's docstring)."""
    unreplayable_masked_tokens: int
    """Generated tokens of calls with options no trainer can replay, masked from TRL's loss."""
    skipped: list[int]
    """Indices of the groups with no accepted member, given placeholders (nothing trained)."""


def rollout_fields(groups: Sequence[Sequence[TrainingSample | None]]) -> Rollouts:
    """TRL's ``rollout_func`` output for groups of samples (None: a rejected member), each
    completion with its calls' sampling options per token (``SAMPLING_FIELD``)."""
    out: dict[str, list[Any]] = {
        name: []
        for name in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            REWARD_FIELD,
            CALL_REWARDS_FIELD,
            SAMPLING_FIELD,
            SAMPLE_KEY_FIELD,
        )
    }
    filled = masked = 0
    skipped: list[int] = []
    for index, group in enumerate(groups):
        accepted = [s for s in group if s is not None]
        if not accepted:
            skipped.append(index)
            for _ in group:
                _placeholder(out, f"skipped group {index}")
            continue
        known = [s.reward for s in accepted if s.reward is not None]
        mean = sum(known) / len(known) if known else 0.0
        for sample in group:
            source = sample or accepted[0]
            part = split(source)
            cut = len(part.prompt_ids)
            per_token = [0.0] * len(part.response_ids)
            for position, reward in span_end_rewards(sample) if sample is not None else []:
                per_token[position - cut] = reward
            out[CALL_REWARDS_FIELD].append(per_token)
            out["prompt_ids"].append(part.prompt_ids)
            out["completion_ids"].append(part.response_ids)
            out["logprobs"].append(part.response_logprobs)
            out[SAMPLING_FIELD].append(completion_sampling(source, cut))
            out[SAMPLE_KEY_FIELD].append(source.key)
            if sample is None:
                filled += 1
                out["env_mask"].append([0] * len(part.response_mask))
                out[REWARD_FIELD].append(mean)
                continue
            mask = list(part.response_mask)
            for begin, end in unreplayable_spans(sample):
                masked += sum(mask[begin - cut : end - cut])
                mask[begin - cut : end - cut] = [0] * (end - begin)
            out["env_mask"].append(mask)
            out[REWARD_FIELD].append(sample.reward if sample.reward is not None else mean)
    return Rollouts(out, filled, masked, skipped)


def _placeholder(out: dict[str, list[Any]], key: str) -> None:
    """One completion that trains nothing: one masked token, reward 0, neutral sampling."""
    out["prompt_ids"].append([PLACEHOLDER_TOKEN])
    out["completion_ids"].append([PLACEHOLDER_TOKEN])
    out["logprobs"].append([0.0])
    out["env_mask"].append([0])
    out[REWARD_FIELD].append(0.0)
    out[CALL_REWARDS_FIELD].append([0.0])
    out[SAMPLING_FIELD].append({name: [neutral] for name, (neutral, _) in OPTIONS.items()})
    out[SAMPLE_KEY_FIELD].append(key)


def completion_sampling(sample: TrainingSample, cut: int) -> dict[str, list[float]]:
    """The replayed options of each token after ``cut`` (``stages.trainer.batch.TokenLayout``)."""
    layout = TokenLayout.empty(1, len(sample.token_ids))
    layout.fill(0, sample)
    return {name: getattr(layout, name)[0, cut:].tolist() for name in OPTIONS}


def prompt_key(prompt: Messages) -> str:
    return json.dumps(prompt, sort_keys=True)


def distinct_in_order(prompts: Sequence[Messages], num_generations: int) -> list[Messages]:
    """The prompts TRL asked for, once each: it repeats each ``num_generations`` times in a row."""
    if len(prompts) % num_generations:
        raise ValueError(f"prompts: {len(prompts)} is not a multiple of num_generations {num_generations}")
    distinct = [prompts[i] for i in range(0, len(prompts), num_generations)]
    for i, prompt in enumerate(distinct):
        chunk = prompts[i * num_generations : (i + 1) * num_generations]
        if any(prompt_key(p) != prompt_key(prompt) for p in chunk):
            raise ValueError("prompts: each prompt must come num_generations times in a row")
    return distinct


@dataclass
class TrlStep:
    step: int
    weight_version: int
    """The weight version the step's rollouts were sampled with."""
    samples: int
    rejected_filled: int
    reward_mean: float | None
    ratio_max_abs_dev: float
    seconds: dict[str, float]
    """Where the step's time went: ``rollout`` (playing its groups), ``wait`` (until they
    were finalized and archived), ``optimizer`` (TRL's forward, backward and step), ``refit``."""
    unreplayable_masked_tokens: int = 0
    """Generated tokens of calls with unreplayable options, masked from TRL's loss."""
    staleness_max: int | None = None
    """The most versions any of the step's samples was behind, by the feed's measure."""
    stale_dropped: int = 0
    """Samples the feed's staleness policy dropped from the step's batch."""
    loss: float | None = None
    """TRL's own loss of the step, as it logged it."""
    trl: dict[str, float] | None = None
    """Everything TRL logged for the step: its loss, its importance ratio against the captured
    logprobs (``sampling/importance_sampling_ratio/*``, ``sampling/sampling_logp_difference/*``),
    its clip fractions (``clip_ratio/*``), entropy, reward statistics."""
    mismatch: dict[str, Any] | None = None
    """The batch's mismatch report under TRL's weights before the step (``stages.trainer.mismatch``;
    None when no group of the step had an accepted sample)."""
    skipped_groups: dict[str, str] = field(default_factory=dict)
    """Group id → why it trained nothing: every member rejected, with their rejection codes."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def emptied(members: Sequence[FinalizedRollout]) -> str:
    """Why a group has nothing to train: its members' rejection codes, counted."""
    codes = Counter(str(m.event.rejection_reason or m.event.status) for m in members)
    listed = ", ".join(f"{code} ×{count}" for code, count in sorted(codes.items()))
    return f"no accepted member: {len(members)} rollouts rejected ({listed})"


class TrlBridge:
    """Everything TRL's thread needs from the run: play groups, take their verified samples,
    refit the worker, acknowledge. ``play`` plays the tasks of the given prompts (one group
    each; paced, they are already playing) and returns their group ids; ``next_batch``
    returns those groups, verified and archived; ``refit`` loads a saved checkpoint into the
    worker as a weight version and only then moves the policy version ``version`` reads;
    ``ack`` forgets a batch."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        play: Callable[[list[Messages]], Coroutine[Any, Any, list[str]]],
        next_batch: Callable[[list[str]], Coroutine[Any, Any, TrainBatch]],
        refit: Callable[[Path, int], Coroutine[Any, Any, None]],
        ack: Callable[[TrainBatch], Coroutine[Any, Any, None]],
        version: Callable[[], int],
        weights_dir: Path,
        step_writer: StepWriter | None = None,
    ) -> None:
        """``step_writer``: where each step's report and logprobs are kept (the inspector's)."""
        self.loop = loop
        self.step_writer = step_writer
        self._play, self._next_batch, self._refit, self._ack = play, next_batch, refit, ack
        self.version = version
        self.weights_dir = weights_dir
        self.steps: list[TrlStep] = []
        self._pending: TrainBatch | None = None
        self._seconds: dict[str, float] = {}
        self._handed_over = 0.0

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func``: one GRPO group per distinct prompt, verified."""
        distinct = distinct_in_order(prompts, trainer.num_generations)
        group_ids, batch = self._on_loop(self._play_and_collect(distinct))
        by_group = {group.group_id: group for group in batch.groups}
        groups: list[list[TrainingSample | None]] = []
        for group_id in group_ids:
            members = sorted(by_group[group_id].members, key=lambda m: m.event.rollout_id)
            groups.append([m.samples[0] if m.samples else None for m in members])
        rollouts = rollout_fields(groups)
        skipped = {group_ids[i]: emptied(by_group[group_ids[i]].members) for i in rollouts.skipped}
        for group_id, reason in skipped.items():
            log.warning("TRL step %d: group %s skipped: %s", len(self.steps) + 1, group_id, reason)
        samples = [s for group in groups for s in group if s is not None]
        rewards = [s.reward for s in samples if s.reward is not None and not math.isnan(s.reward)]
        version = self.version()
        reward_mean = sum(rewards) / len(rewards) if rewards else None
        mismatch: dict[str, Any] | None = None
        if len(batch):
            mismatch, logprobs = measure(trainer.model, batch, policy_version=version)
            if self.step_writer is not None:
                self.step_writer.write(
                    len(self.steps) + 1, version, mismatch, logprobs, reward_mean=reward_mean
                )
        self.steps.append(
            TrlStep(
                step=len(self.steps) + 1,
                weight_version=version,
                samples=len(samples),
                rejected_filled=rollouts.filled,
                reward_mean=reward_mean,
                ratio_max_abs_dev=(mismatch or {}).get("max_abs_dev") or 0.0,
                seconds=self._seconds,
                unreplayable_masked_tokens=rollouts.unreplayable_masked_tokens,
                staleness_max=int(batch.staleness.max()) if len(batch) else None,
                stale_dropped=len(batch.stale),
                mismatch=mismatch,
                skipped_groups=skipped,
            )
        )
        self._pending = batch
        self._handed_over = time.monotonic()
        return rollouts.fields

    async def _play_and_collect(self, prompts: list[Messages]) -> tuple[list[str], TrainBatch]:
        began = time.monotonic()
        group_ids = await self._play(prompts)
        played = time.monotonic()
        batch = await self._next_batch(group_ids)
        self._seconds = {"rollout": round(played - began, 3), "wait": round(time.monotonic() - played, 3)}
        return group_ids, batch

    def after_step(self, model: Any, step: int) -> None:
        """Save TRL's weights, refit the worker to them as version ``step`` (which moves the
        policy version), then acknowledge."""
        stepped = time.monotonic()
        path = self.weights_dir / f"step-{step}"
        model.save_pretrained(str(path))
        self._on_loop(self._refit(path, step))
        if self.steps:
            self.steps[-1].seconds["optimizer"] = round(stepped - self._handed_over, 3)
            self.steps[-1].seconds["refit"] = round(time.monotonic() - stepped, 3)
        if self._pending is not None:
            self._on_loop(self._ack(self._pending))
            self._pending = None

    def logged(self, logs: dict[str, Any]) -> None:
        """TRL's log of a step (``logging_steps`` 1: one per step) goes on that step, and into
        its step file beside the mismatch report."""
        if "loss" in logs and self.steps and self.steps[-1].trl is None:
            step = self.steps[-1]
            step.loss = float(logs["loss"])
            step.trl = {name: float(value) for name, value in logs.items() if isinstance(value, int | float)}
            if self.step_writer is not None and step.mismatch is not None:  # its file was written
                self.step_writer.add_trainer_metrics(step.step, step.trl)


IMPORTANCE_SAMPLING_MODE = "token_truncate"
"""TRL's importance correction against the captured logprobs: each token's ratio
``exp(trainer - behaviour)`` weighs its loss, capped (truncated importance sampling)."""
IMPORTANCE_SAMPLING_CAP = 2.0
"""The cap, the mismatch report's ``tis_cap`` (``stages.trainer.mismatch.Bounds``)."""


def grpo_trainer(
    model_dir: Path,
    prompts: Sequence[Messages],
    *,
    rollout_func: Callable[[list[Any], Any], dict[str, Any]],
    serving: Callable[[], int],
    callbacks: Sequence[Any] = (),
    group_size: int,
    groups_per_step: int,
    steps: int,
    learning_rate: float,
    output_dir: Path,
    seed: int,
    dtype: TrainerDtype = "float32",
) -> Any:
    """TRL's ``GRPOTrainer`` replaying each call's sampling (``trl_replay``) over ``prompts``
    in order, one generation per optimizer step, ``beta`` 0, its importance correction on."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl.trainer.grpo_config import GRPOConfig

    from pipeline.trainer.trl_replay import ReplayingGRPOTrainer

    config = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=group_size * groups_per_step,
        num_generations=group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        max_steps=steps,
        learning_rate=learning_rate,
        beta=0.0,
        shuffle_dataset=False,
        max_completion_length=None,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # no autocast: the weights' own dtype is the trainer's precision
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=IMPORTANCE_SAMPLING_MODE,
        vllm_importance_sampling_clip_max=IMPORTANCE_SAMPLING_CAP,
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = ReplayingGRPOTrainer(
        model=model,
        reward_funcs=[environment_reward],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tokenizer,
        rollout_func=rollout_func,
        callbacks=list(callbacks),
        serving=serving,
    )
    trainer.remove_callback(PrinterCallback)  # the run reports the steps; its stdout is its JSON
    return trainer


def train(bridge: TrlBridge, model_dir: Path, prompts: Sequence[Messages], **settings: Any) -> None:
    """Run TRL's trainer (``grpo_trainer``, ``settings`` its keywords) for its steps, each
    step's weights refit to the worker (in TRL's training thread: call it with
    ``asyncio.to_thread``)."""
    from transformers import TrainerCallback

    class Sync(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            bridge.after_step(model, state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            bridge.logged(logs or {})

    trainer = grpo_trainer(
        model_dir,
        prompts,
        rollout_func=bridge.rollout_func,
        serving=bridge.version,
        callbacks=[Sync()],
        **settings,
    )
    trainer.train()


__all__ = [
    "CALL_REWARDS_FIELD",
    "REWARD_FIELD",
    "Rollouts",
    "TrlBridge",
    "TrlStep",
    "completion_sampling",
    "distinct_in_order",
    "emptied",
    "environment_reward",
    "grpo_trainer",
    "rollout_fields",
    "train",
]
