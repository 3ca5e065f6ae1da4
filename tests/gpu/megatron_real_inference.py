"""Real Megatron-Core dynamic inference with tokentrail's capture hooks, on one CUDA GPU.

Not a pytest module (pytest collects ``test_*.py`` only): a prepared check for a machine
with a CUDA GPU, where it runs in a minute or two. From the repository root:

    python tests/gpu/megatron_real_inference.py --json            # the check
    python tests/gpu/megatron_real_inference.py --preflight --json  # imports and APIs only (CPU)

What it does:
1. Builds a tiny GPT (2 layers, hidden 128, vocab 512, bf16, random weights) with
   megatron-core on CUDA, and a ``DynamicInferenceEngine`` over it (single rank).
2. Feature-detects the ``prompt_preparer`` / ``payload_stager`` hooks and installs them if
   present (Megatron-LM main since PR 7015); 0.19.2 has neither, which is reported. In
   direct (non-coordinator) mode the engine does not call them even on main, so the
   driver calls the two hooks exactly where main's coordinator path does: the preparer
   right before ``add_request``, the stager for each finished request record.
3. Runs concurrent 3-turn token-in rollouts: each turn's prompt is the exact ids of the
   previous call plus new "user" tokens. Midway it sets a new generation epoch (stamped
   on the active requests exactly as the engine's ``schedule_requests`` does for a
   SET_GENERATION_EPOCH message) and perturbs the weights, so calls straddle a refit.
4. Finalizes every rollout through the ledger and finalizer stages on in-memory ports,
   and checks each sample against the engine's own request records: ids, logprobs
   (float32), mask, per-token weight versions; plus: no capture failure, no superseded
   coords, at least one call with epoch spans.

Prints a JSON report (``--json``) and exits 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import numpy as np

T = TypeVar("T")
VOCAB = 512
EOD = 2  # end of a turn, and the engine's termination id
USER_TOKENS = 6


# ------------------------------------------------------------------- preflight


def preflight() -> dict[str, Any]:
    """Import everything the check uses and confirm the API shapes it relies on (no GPU)."""
    import inspect
    from importlib import metadata

    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    source = inspect.getsource(DynamicInferenceEngine)
    return {
        "megatron_core": metadata.version("megatron-core"),
        "engine_declares_hooks": "payload_stager" in source and "prompt_preparer" in source,
        "context_signature": str(inspect.signature(DynamicInferenceContext.__init__)),
        "controller_signature": str(inspect.signature(TextGenerationController.__init__)),
        "wrapper_signature": str(inspect.signature(GPTInferenceWrapper.__init__)),
        "inference_config_has": sorted(
            name
            for name in (
                "max_sequence_length",
                "buffer_size_gb",
                "max_requests",
                "materialize_only_last_token_logits",
            )
            if name in InferenceConfig.__dataclass_fields__
        ),
    }


# ---------------------------------------------------------------------- engine


class ByteTokenizer:
    """Enough of a tokenizer for the controller: ids 3..258 are bytes, 2 ends a turn."""

    eod = EOD
    bos = None
    vocab_size = VOCAB

    def tokenize(self, text: str) -> list[int]:
        return [3 + b for b in text.encode()]

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


def init_single_rank() -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(0)
        torch.distributed.init_process_group(backend="nccl", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)


def build_engine(max_sequence_length: int) -> tuple[Any, Any]:
    import torch
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=256,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
        inference_rng_tracker=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=max_sequence_length,
        parallel_output=True,
        pre_process=True,
        post_process=True,
    ).cuda()
    for param in model.parameters():
        param.data = param.data.to(config.params_dtype)
    model.eval()
    context = DynamicInferenceContext(
        config,
        InferenceConfig(
            max_sequence_length=max_sequence_length,
            buffer_size_gb=1,
            max_requests=32,
            materialize_only_last_token_logits=True,
        ),
    )
    wrapped = GPTInferenceWrapper(model, context)
    controller = TextGenerationController(wrapped, ByteTokenizer())
    return DynamicInferenceEngine(controller, context), model


def set_generation_epoch(engine: Any, epoch: int) -> None:
    """What ``schedule_requests`` does for SET_GENERATION_EPOCH (pinned by the contract test)."""
    engine._generation_epoch = epoch
    for entry in engine.requests.values():
        request = entry.record[-1]
        total = len(request.prompt_tokens) + len(request.generated_tokens)
        if total > 0:
            if request.policy_epoch is None:
                request.policy_epoch = [(0, epoch)]
            else:
                request.policy_epoch.append((total - 1, epoch))


def refit_weights(model: Any, seed: int) -> None:
    """Stand-in for a weight refit: nudge every parameter, in place."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
            param.add_((noise * 0.02).to(param.dtype))


# --------------------------------------------------------------------- capture


class CaptureLoop:
    """The worker's capture loop on its own thread, as beside a real engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="capture", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Capture:
    """Capture core, hooks and driver on in-memory ports."""

    def __init__(self, loop: CaptureLoop) -> None:
        from stages.capture.cache import ChainCache
        from stages.capture.core import AckPolicy, CaptureCore
        from stages.capture.megatron.preparer import MegatronPromptPreparer
        from stages.capture.megatron.registry import PreparedCalls
        from stages.capture.megatron.stager import MegatronPayloadStager
        from stages.capture.resolve import PrefixResolver
        from stages.capture.writer import StagingWriter
        from stages.client import RolloutClient
        from stages.memory import MemoryDataPlane, RecordingSink

        self.loop = loop
        self.data_plane = MemoryDataPlane()
        self.events = RecordingSink()
        cache = ChainCache()
        self.writer = StagingWriter(self.data_plane, self.events, worker_id="gpu", batch_delay_s=0.0)
        self.core = CaptureCore(
            PrefixResolver(self.data_plane, cache), self.writer, cache, ack_policy=AckPolicy.ENQUEUED
        )
        registry = PreparedCalls()
        self.preparer = MegatronPromptPreparer(self.core, registry, eos_token_ids=[EOD], loop=loop.loop)
        self.stager = MegatronPayloadStager(self.core, registry)
        self.client = RolloutClient(self.events)

        async def start() -> None:
            self.writer.start()
            self.stager.start()

        loop.run(start())

    def stop(self) -> None:
        async def stop() -> None:
            await self.stager.drain()
            await self.stager.stop()
            await self.writer.stop()

        self.loop.run(stop())


# ---------------------------------------------------------------------- driver


def run_rollouts(
    engine: Any, model: Any, capture: Capture, rollouts: int, turns: int, max_tokens: int
) -> dict[str, Any]:
    from megatron.core.inference.sampling_params import SamplingParams

    from stages.client import RolloutClient

    rng = np.random.default_rng(0)
    engine._generation_epoch = 0  # as if the trainer had published epoch 0 before serving
    exact: dict[str, list[int]] = {f"g{i}": [] for i in range(rollouts)}
    coords: dict[str, Any] = dict.fromkeys(exact)
    calls: dict[str, list[Any]] = {rollout: [] for rollout in exact}  # engine records per rollout
    params_of: dict[int, tuple[str, dict[str, Any]]] = {}
    request_ids = iter(range(1, 1_000_000))
    refit_done = False
    step_ms: list[float] = []
    for turn in range(turns):
        for rollout in exact:
            admission = capture.client.admit(rollout, coords[rollout], group_id="gpu")
            capture.loop.run(capture.client.publish_admission(admission))
            capture.preparer.prefetch_threadsafe(admission).result(30)  # before admission, off the step
            user = [3 + int(b) for b in rng.integers(0, 256, USER_TOKENS)]
            history = exact[rollout]
            closing = [EOD] if history and history[-1] != EOD else []  # close the previous turn
            prompt = [*history, *closing, *user]
            params = RolloutClient.request_body({}, admission)
            prepared = capture.preparer.prepare_prompt(prompt, offload_params=params)  # main: rank 0, in step
            request_id = next(request_ids)
            params_of[request_id] = (rollout, dict(prepared.offload_params or {}))
            sampling = SamplingParams(
                temperature=1.0,
                top_k=0,
                return_log_probs=True,
                skip_prompt_log_probs=True,
                num_tokens_to_generate=max_tokens,
                termination_id=EOD,
            )
            engine.add_request(request_id, list(prepared.prompt), sampling)
        steps_this_turn = 0
        while engine.has_unfinished_requests():
            if turn == 1 and steps_this_turn == 3 and not refit_done:
                refit_weights(model, seed=7)
                set_generation_epoch(engine, 1)
                refit_done = True
            started = time.perf_counter()
            result = engine.step_modern()
            step_ms.append((time.perf_counter() - started) * 1e3)
            steps_this_turn += 1
            for record in result["finished_request_records"]:
                rollout, params = params_of.pop(record.request_id)
                staged = capture.stager.stage(
                    f"resp-{record.request_id}", record, finished_metadata=None, offload_params=params
                )  # main: rank 0, in bookkeeping
                if staged is None:
                    raise RuntimeError(f"request {record.request_id} was not captured")
                coords[rollout] = staged.coords
                merged = record.merge()
                calls[rollout].append(merged)
                exact[rollout] = [*merged.prompt_tokens.tolist(), *merged.generated_tokens]
    for rollout in exact:
        capture.loop.run(capture.client.seal(rollout, group_id="gpu", reward=1.0))
    return {"calls": calls, "coords": coords, "step_ms_p50": float(np.median(step_ms)), "steps": len(step_ms)}


def finalize(capture: Capture) -> list[Any]:
    from stages.finalize.stage import FinalizerStage
    from stages.ledger.stage import LedgerConfig, LedgerStage
    from stages.memory import RecordingSink
    from stages.ports import Consumed
    from topics.events import envelope
    from topics.records import FinalizedEvent, RolloutReceipt

    async def go() -> list[Any]:
        events = [event.payload for event in capture.events.events]
        ledger_out = RecordingSink()
        ledger = LedgerStage(ledger_out, LedgerConfig())
        await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate(events)])
        await ledger.tick(math.inf)  # the log is over (its events all stamped 0): close what is left
        receipts = ledger_out.payloads(RolloutReceipt)
        final_out = RecordingSink()
        await FinalizerStage(capture.data_plane, final_out).handle(
            [Consumed("com", 0, i, envelope(r)) for i, r in enumerate(receipts)]
        )
        return final_out.payloads(FinalizedEvent)

    return capture.loop.run(go())


def verify(capture: Capture, calls: dict[str, list[Any]], finalized: list[Any]) -> list[str]:
    """Every sample against the engine's records; returns the problems found."""
    from stages.capture.megatron.payload import generation_versions

    problems: list[str] = []
    status = {event.rollout_id: event for event in finalized}
    straddled = 0
    for rollout, requests in calls.items():
        event = status.get(rollout)
        if event is None or event.status != "accepted":
            problems.append(f"{rollout}: {None if event is None else event.rejection_reason}")
            continue
        sample = capture.data_plane.samples[rollout]
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for request in requests:
            prompt = request.prompt_tokens.tolist()
            carry = prompt[len(ids) :]
            generated = list(request.generated_tokens)
            epochs = generation_versions(request.policy_epoch, len(prompt), len(generated))
            straddled += epochs.spans is not None
            per_token = [epochs.weight_version] * len(generated)
            for offset, version in epochs.spans or []:
                per_token[offset:] = [version] * (len(generated) - offset)
            ids += carry + generated
            logprobs += [0.0] * len(carry) + [float(np.float32(v)) for v in request.generated_log_probs]
            versions += [epochs.weight_version] * len(carry) + per_token
        if sample.token_ids != ids:
            problems.append(f"{rollout}: token ids differ from the engine's")
        if sample.logprobs != logprobs:
            problems.append(f"{rollout}: logprobs differ from the engine's")
        if sample.weight_versions != versions:
            problems.append(f"{rollout}: weight versions differ from the policy epochs")
    if straddled == 0:
        problems.append("no call straddled the refit")
    stats = capture.stager.stats
    if stats.failed or stats.superseded or stats.errors:
        problems.append(f"stager: {stats}")
    return problems


# ------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--preflight", action="store_true", help="imports and API shapes only; no GPU")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"check": "megatron_real_inference", "ok": False}
    phase = "preflight"
    loop: CaptureLoop | None = None
    try:
        report["preflight"] = preflight()
        if args.preflight:
            report["ok"] = True
            return _emit(report, args.json, 0)
        import torch

        if not torch.cuda.is_available():
            report["error"] = "no CUDA device: megatron-core inference needs one"
            return _emit(report, args.json, 2)
        report["device"] = torch.cuda.get_device_name(0)
        phase = "init"
        init_single_rank()
        phase = "build"
        max_len = args.turns * (args.max_tokens + USER_TOKENS + 1) + 64
        engine, model = build_engine(max_len)
        phase = "hooks"
        from stages.capture.megatron.install import install_capture_hooks

        loop = CaptureLoop()
        capture = Capture(loop)
        report["hooks_installed"] = install_capture_hooks(engine, capture.preparer, capture.stager)
        phase = "rollouts"
        started = time.perf_counter()
        run = run_rollouts(engine, model, capture, args.rollouts, args.turns, args.max_tokens)
        report.update(steps=run["steps"], step_ms_p50=round(run["step_ms_p50"], 3))
        report["rollout_s"] = round(time.perf_counter() - started, 2)
        phase = "finalize"
        capture.stop()
        finalized = finalize(capture)
        phase = "verify"
        problems = verify(capture, run["calls"], finalized)
        report.update(
            rollouts=args.rollouts,
            accepted=sum(event.status == "accepted" for event in finalized),
            problems=problems,
            preparer=str(capture.preparer.stats),
            stager=str(capture.stager.stats),
            ok=not problems,
        )
        return _emit(report, args.json, 0 if not problems else 1)
    except Exception as exc:
        report.update(
            failed_phase=phase, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
        )
        return _emit(report, args.json, 1)
    finally:
        if loop is not None:
            loop.close()


def _emit(report: dict[str, Any], as_json: bool, code: int) -> int:
    if as_json:
        print(json.dumps(report, default=str))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return code


if __name__ == "__main__":
    sys.exit(main())
