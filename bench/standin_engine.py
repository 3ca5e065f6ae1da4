"""A continuous-batching stand-in engine driven by a real causal LM, for the engine benchmark.

Megatron-Core cannot run inference on CPU, and what the benchmark has to show is where
capture work lands relative to the engine step, not how fast a model is. So this engine
keeps Megatron's dynamic-engine structure and nothing more: requests wait in an inbox,
each ``step`` admits as many as the batch has room for, runs one batched forward pass of
a real Hugging Face causal LM over every active sequence, appends one greedy token per
request, and finishes the requests whose budget is spent. It calls the two capture
hooks where Megatron-LM main calls them, inside ``step`` on the engine's thread:
``prompt_preparer.prepare_prompt`` when a request is admitted into the batch and
``payload_stager.stage`` when it finishes. A hook that waits therefore stalls the whole
batch, exactly the cost the benchmark measures.

Generation never stops at an end-of-sequence token: every request runs to its budget,
so that each capture mode does the same model work and only the hooks differ. There is
no KV cache: each step recomputes the active sequences (left-padded), which keeps step
time in the tens of milliseconds for the tiny model, the range of a real engine step.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class PromptPreparer(Protocol):
    """Megatron-LM main's ``prompt_preparer`` hook shape."""

    def prepare_prompt(
        self, prompt: Any, *, offload_params: Mapping[str, Any] | None
    ) -> tuple[Any, Mapping[str, Any] | None]: ...


class StagedReply(Protocol):
    """What a payload stager returns for a captured request: fields merged into the reply."""

    @property
    def response_metadata(self) -> dict[str, Any]: ...


class PayloadStager(Protocol):
    """Megatron-LM main's ``payload_stager`` hook shape."""

    def stage(
        self,
        uid: Any,
        payload: Any,
        *,
        finished_metadata: Any = None,
        offload_params: Mapping[str, Any] | None = None,
    ) -> StagedReply | None: ...


class CausalLM:
    """Greedy next tokens and their logprobs for a batch of id sequences, on CPU.

    ``threads`` bounds torch's intra-op threads: on a small machine one core runs the
    model and the others are left to everything around it, as a GPU engine leaves the
    host CPU to the serving loop.
    """

    def __init__(self, model_dir: Path, *, threads: int = 1) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self._torch = torch
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
        self.model = model
        self.vocab_size = int(self.model.config.vocab_size)

    def next_tokens(self, sequences: Sequence[Sequence[int]]) -> tuple[list[int], list[float]]:
        """One forward pass over left-padded ``sequences``; the argmax token of each and its logprob."""
        torch = self._torch
        width = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.int64)
        mask = torch.zeros((len(sequences), width), dtype=torch.int64)
        for row, sequence in enumerate(sequences):
            ids[row, width - len(sequence) :] = torch.as_tensor(sequence, dtype=torch.int64)
            mask[row, width - len(sequence) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
            logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            best = logprobs.argmax(dim=-1)
            chosen = logprobs.gather(1, best[:, None])[:, 0]
        return [int(t) for t in best.tolist()], [float(x) for x in chosen.tolist()]


@dataclass(frozen=True, slots=True)
class Reply:
    """What a finished request returns: its generated ids and the hook's reply fields."""

    uid: str
    generated: list[int]
    metadata: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step: wall times (``time.perf_counter``), work done, time in hooks and in the model.

    The rest of a step (``seconds - hook_s - forward_s``) is the engine's own bookkeeping.
    """

    start: float
    end: float
    tokens: int
    batch: int
    admitted: int
    finished: int
    hook_s: float
    forward_s: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class _Request:
    uid: str
    prompt: list[int]
    offload_params: Mapping[str, Any] | None
    budget: int
    reply: concurrent.futures.Future[Reply]
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class BatchEngine:
    """Continuous batching over ``lm`` with Megatron-LM main's two hook attributes.

    ``submit`` is thread-safe; ``step`` runs on one engine thread. Every request's
    policy epoch is ``epoch`` (no refits here).
    """

    def __init__(self, lm: CausalLM, *, max_batch: int, epoch: int = 0) -> None:
        if max_batch <= 0:
            raise ValueError(f"max_batch: must be > 0, got {max_batch}")
        self.prompt_preparer: PromptPreparer | None = None
        self.payload_stager: PayloadStager | None = None
        self.lm = lm
        self.max_batch = max_batch
        self.epoch = epoch
        self.steps: list[StepRecord] = []
        self._inbox: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit(
        self, prompt: list[int], offload_params: Mapping[str, Any] | None, *, max_tokens: int
    ) -> concurrent.futures.Future[Reply]:
        """Queue a request of exactly ``max_tokens`` generated tokens."""
        if max_tokens <= 0:
            raise ValueError(f"max_tokens: must be > 0, got {max_tokens}")
        reply: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        request = _Request(f"resp-{next(self._ids)}", list(prompt), offload_params, max_tokens, reply)
        with self._lock:
            self._inbox.append(request)
        return reply

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._active)

    def step(self) -> StepRecord:
        """Admit, forward once, finish; the hooks run inside, on this thread."""
        start = time.perf_counter()
        hook_s = 0.0
        admitted = 0
        with self._lock:
            room = self.max_batch - len(self._active)
            incoming = [self._inbox.popleft() for _ in range(min(room, len(self._inbox)))]
        for request in incoming:
            if self.prompt_preparer is not None:
                began = time.perf_counter()
                prompt, params = self.prompt_preparer.prepare_prompt(
                    request.prompt, offload_params=request.offload_params
                )
                hook_s += time.perf_counter() - began
                request.prompt, request.offload_params = list(prompt), params
            self._active.append(request)
            admitted += 1
        batch = len(self._active)
        finished = 0
        forward_s = 0.0
        if self._active:
            began = time.perf_counter()
            tokens, logprobs = self.lm.next_tokens([r.prompt + r.generated for r in self._active])
            forward_s = time.perf_counter() - began
            still: list[_Request] = []
            for request, token, logprob in zip(self._active, tokens, logprobs, strict=True):
                request.generated.append(token)
                request.logprobs.append(logprob)
                if len(request.generated) < request.budget:
                    still.append(request)
                    continue
                hook_s += self._finish(request)
                finished += 1
            self._active = still
        record = StepRecord(start, time.perf_counter(), batch, batch, admitted, finished, hook_s, forward_s)
        self.steps.append(record)
        return record

    def _finish(self, request: _Request) -> float:
        """Stage (if hooked) and reply; returns the seconds spent in the hook."""
        metadata: dict[str, Any] | None = None
        hook_s = 0.0
        if self.payload_stager is not None:
            # Megatron-LM main's OffloadedRequestPayload and FinishedRequestRecord, as mappings.
            payload = {
                "prompt_token_ids": request.prompt,
                "generated_token_ids": request.generated,
                "generated_log_probs": request.logprobs,
            }
            began = time.perf_counter()
            result = self.payload_stager.stage(
                request.uid,
                payload,
                finished_metadata={"policy_epoch": [(0, self.epoch)]},
                offload_params=request.offload_params,
            )
            hook_s = time.perf_counter() - began
            metadata = None if result is None else result.response_metadata
        request.reply.set_result(Reply(request.uid, request.generated, metadata))
        return hook_s


class EngineThread:
    """Steps the engine on its own thread whenever it has work, as a serving loop does."""

    def __init__(self, engine: BatchEngine, *, idle_s: float = 0.0005) -> None:
        self.engine = engine
        self.idle_s = idle_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-engine", daemon=True)

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Finish the step in progress and stop (blocking: call it off any loop a hook waits on)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine thread did not stop within {timeout_s}s")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.engine.has_work():
                    self.engine.step()
                else:
                    self._stop.wait(self.idle_s)
        except BaseException as exc:  # reported by the benchmark, never swallowed
            self.error = exc
            raise


__all__ = [
    "BatchEngine",
    "CausalLM",
    "EngineThread",
    "PayloadStager",
    "PromptPreparer",
    "Reply",
    "StagedReply",
    "StepRecord",
]
