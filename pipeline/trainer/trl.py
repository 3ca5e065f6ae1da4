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
the accepted members (the group's mean unchanged, its advantage 0), and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.trainer.recompute import measure
from pipeline.trainer.shapes import split
from pipeline.trainer.steplog import StepWriter
from stages.trainer.batch import TrainBatch, span_end_rewards
from topics.records import TrainingSample

log = logging.getLogger(__name__)

REWARD_FIELD = "tokentrail_reward"
"""The extra field of ``rollout_func``'s output that carries each completion's reward."""
CALL_REWARDS_FIELD = "tokentrail_call_rewards"
"""The extra field with each completion's per-token call rewards (``TrainBatch.call_rewards``,
aligned with ``completion_ids``), for reward functions that score turns."""
T = TypeVar("T")
Messages = list[dict[str, Any]]


def environment_reward(
    prompts: Sequence[Any], completions: Sequence[Any], **fields: Any
) -> list[float | None]:
    """A TRL reward function: the reward the environment sealed each rollout with."""
    rewards: list[float | None] = fields[REWARD_FIELD]
    return rewards


def rollout_fields(groups: Sequence[Sequence[TrainingSample | None]]) -> tuple[dict[str, list[Any]], int]:
    """TRL's ``rollout_func`` output for groups of samples (None: a rejected member), and
    how many rejected members were filled in (see the module's docstring)."""
    out: dict[str, list[Any]] = {
        name: []
        for name in ("prompt_ids", "completion_ids", "logprobs", "env_mask", REWARD_FIELD, CALL_REWARDS_FIELD)
    }
    filled = 0
    for group in groups:
        accepted = [s for s in group if s is not None]
        if not accepted:
            raise ValueError(f"group of {len(group)}: no member has a verified sample to train on")
        known = [s.reward for s in accepted if s.reward is not None]
        mean = sum(known) / len(known) if known else 0.0
        for sample in group:
            part = split(sample or accepted[0])
            per_token = [0.0] * len(part.response_ids)
            for position, reward in span_end_rewards(sample) if sample is not None else []:
                per_token[position - len(part.prompt_ids)] = reward
            out[CALL_REWARDS_FIELD].append(per_token)
            out["prompt_ids"].append(part.prompt_ids)
            out["completion_ids"].append(part.response_ids)
            out["logprobs"].append(part.response_logprobs)
            if sample is None:
                filled += 1
                out["env_mask"].append([0] * len(part.response_mask))
                out[REWARD_FIELD].append(mean)
            else:
                out["env_mask"].append(part.response_mask)
                out[REWARD_FIELD].append(sample.reward if sample.reward is not None else mean)
    return out, filled


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
    loss: float | None = None
    """TRL's own loss of the step, as it logged it."""
    mismatch: dict[str, Any] | None = None
    """The batch's mismatch report under TRL's weights before the step (``stages.trainer.mismatch``)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class TrlBridge:
    """Everything TRL's thread needs from the run: play groups, take their verified samples,
    refit the worker, acknowledge. ``play`` plays the tasks of the given prompts (one group
    each) and returns once they are sealed; ``next_batch`` returns their groups, verified;
    ``refit`` loads a saved checkpoint into the worker as a weight version; ``ack`` forgets
    a batch; ``policy_version`` is read and set through ``version``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        play: Callable[[list[Messages]], Coroutine[Any, Any, list[str]]],
        next_batch: Callable[[], Coroutine[Any, Any, TrainBatch]],
        refit: Callable[[Path, int], Coroutine[Any, Any, None]],
        ack: Callable[[TrainBatch], Coroutine[Any, Any, None]],
        version: Callable[[int | None], int],
        weights_dir: Path,
        temperature: float,
        step_writer: StepWriter | None = None,
    ) -> None:
        """``step_writer``: where each step's report and logprobs are kept (the inspector's)."""
        self.loop = loop
        self.step_writer = step_writer
        self._play, self._next_batch, self._refit, self._ack = play, next_batch, refit, ack
        self._version = version
        self.weights_dir = weights_dir
        self.temperature = temperature or 1.0
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
        out, filled = rollout_fields(groups)
        samples = [s for group in groups for s in group if s is not None]
        rewards = [s.reward for s in samples if s.reward is not None and not math.isnan(s.reward)]
        version = self._version(None)
        mismatch, logprobs = measure(trainer.model, batch, policy_version=version)
        if self.step_writer is not None:
            self.step_writer.write(len(self.steps) + 1, version, mismatch, logprobs)
        self.steps.append(
            TrlStep(
                step=len(self.steps) + 1,
                weight_version=version,
                samples=len(samples),
                rejected_filled=filled,
                reward_mean=sum(rewards) / len(rewards) if rewards else None,
                ratio_max_abs_dev=mismatch["max_abs_dev"] or 0.0,
                seconds=self._seconds,
                mismatch=mismatch,
            )
        )
        self._pending = batch
        self._handed_over = time.monotonic()
        return out

    async def _play_and_collect(self, prompts: list[Messages]) -> tuple[list[str], TrainBatch]:
        began = time.monotonic()
        group_ids = await self._play(prompts)
        played = time.monotonic()
        batch = await self._next_batch()
        self._seconds = {"rollout": round(played - began, 3), "wait": round(time.monotonic() - played, 3)}
        return group_ids, batch

    def after_step(self, model: Any, step: int) -> None:
        """Save TRL's weights, refit the worker to them as version ``step``, then acknowledge."""
        stepped = time.monotonic()
        path = self.weights_dir / f"step-{step}"
        model.save_pretrained(str(path))
        self._on_loop(self._refit(path, step))
        if self.steps:
            self.steps[-1].seconds["optimizer"] = round(stepped - self._handed_over, 3)
            self.steps[-1].seconds["refit"] = round(time.monotonic() - stepped, 3)
        self._version(step)
        if self._pending is not None:
            self._on_loop(self._ack(self._pending))
            self._pending = None

    def logged(self, logs: dict[str, Any]) -> None:
        if "loss" in logs and self.steps and self.steps[-1].loss is None:
            self.steps[-1].loss = float(logs["loss"])


def train(
    bridge: TrlBridge,
    model_dir: Path,
    prompts: Sequence[Messages],
    *,
    group_size: int,
    groups_per_step: int,
    steps: int,
    learning_rate: float,
    output_dir: Path,
    seed: int,
) -> None:
    """Run TRL's ``GRPOTrainer`` for ``steps`` optimizer steps over ``prompts`` in order (in
    TRL's training thread: call it with ``asyncio.to_thread``)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Sync(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            bridge.after_step(model, state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            bridge.logged(logs or {})

    config = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=group_size * groups_per_step,
        num_generations=group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        max_steps=steps,
        learning_rate=learning_rate,
        temperature=bridge.temperature,
        beta=0.0,
        shuffle_dataset=False,
        max_completion_length=None,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default; fp32 recomputes exactly the logprobs the worker sampled with
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[environment_reward],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tokenizer,
        rollout_func=bridge.rollout_func,
        callbacks=[Sync()],
    )
    trainer.remove_callback(PrinterCallback)  # the run reports the steps; its stdout is its JSON
    trainer.train()


__all__ = [
    "CALL_REWARDS_FIELD",
    "REWARD_FIELD",
    "TrlBridge",
    "TrlStep",
    "distinct_in_order",
    "environment_reward",
    "rollout_fields",
    "train",
]
