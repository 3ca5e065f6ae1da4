"""The worker's splice as the conversation grows: CPU per call at 10, 100 and 1,000 turns.

Every captured chat call that continues a chain costs the worker two renders of the
conversation: vLLM's own render of the whole prompt (which it does with or without
capture) and the splice's render of the history through the parent's assistant turn,
whose count of turn-closing tokens the splice checks against the exact prefix (DESIGN
§5). Both are whole-conversation Jinja renders plus tokenization, so both grow with the
conversation; this measures by how much, side by side in one run, on the tiny model's
tokenizer with the ChatML template and the reasoning-stripping one (which re-renders
earlier turns differently, as Qwen3 does). CPU time of this process, best of
``--rounds``.

Run: ``tokentrail bench splice [--quick] [--json]``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.command import Benchmark, Option, Quick, ints
from bench.common import best_of, machine, versions
from pipeline.models.tiny import chatml_template, make_tiny_model, reasoning_stripping_template
from stages.capture.chat import ChatRenderer

TEMPLATES: dict[str, Callable[[], str]] = {
    "chatml": chatml_template,
    "strip_reasoning": reasoning_stripping_template,
}


@dataclass(frozen=True, slots=True)
class SpliceBenchConfig:
    turns: tuple[int, ...] = (10, 100, 1000)
    rounds: int = 5
    calls: int = 20
    """Calls timed per round at 10 turns; fewer at more turns, never under 2."""


QUICK = Quick("10 and 100 turns, 2 rounds", SpliceBenchConfig(turns=(10, 100), rounds=2, calls=5))
OPTIONS = (
    Option("--turns", "conversation lengths (default 10,100,1000)", ints),
    Option("--rounds", "rounds, best kept (default 5)", int),
)


def conversation(turns: int) -> list[dict[str, Any]]:
    """``turns`` user questions, each answered with a little reasoning, and a last question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You add numbers."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"What is {turn} + {turn + 1}?"})
        messages.append(
            {
                "role": "assistant",
                "content": f"<think>\nAdd them.\n</think>\n\nIt is {2 * turn + 1}.",
            }
        )
    messages.append({"role": "user", "content": "Thanks. And now?"})
    return messages


def _cpu_ms(work: Callable[[], object], calls: int, rounds: int) -> float:
    return round(best_of(work, calls, rounds, clock=time.process_time) * 1e3, 3)


def measure(renderer: ChatRenderer, turns: int, config: SpliceBenchConfig) -> dict[str, Any]:
    messages = conversation(turns)
    history = renderer.render(messages[:-1])
    eos = renderer.eos_token_ids
    last_eos = max(i for i, token in enumerate(history) if token in eos)
    exact = history[: last_eos + 1]  # what the engine saw and produced through its last reply
    full = renderer.render(messages)
    calls = max(2, config.calls * 10 // max(10, turns))
    render_ms = _cpu_ms(lambda: renderer.render(messages), calls, config.rounds)
    splice_ms = _cpu_ms(lambda: renderer.spliced(exact, messages, None, full), calls, config.rounds)
    return {
        "turns": turns,
        "prompt_tokens": len(full),
        "vllm_render_ms": render_ms,
        "splice_ms": splice_ms,
        "splice_over_render": round(splice_ms / render_ms, 3) if render_ms else None,
    }


def run(config: SpliceBenchConfig = SpliceBenchConfig()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-splice-") as scratch:
        model_dir = make_tiny_model(Path(scratch) / "model")
        rows = []
        for name, template in TEMPLATES.items():
            renderer = ChatRenderer.from_pretrained(model_dir, chat_template=template())
            rows += [{"template": name, **measure(renderer, turns, config)} for turns in config.turns]
    return {
        "config": asdict(config),
        "machine": machine(),
        "versions": versions(("transformers", "tokenizers", "jinja2")),
        "rows": rows,
    }


def render(report: dict[str, Any]) -> str:
    lines = ["template         turns  tokens  vLLM render ms  splice ms  splice/render"]
    for row in report["rows"]:
        lines.append(
            f"{row['template']:<16} {row['turns']:>5} {row['prompt_tokens']:>7} "
            f"{row['vllm_render_ms']:>15} {row['splice_ms']:>10} {row['splice_over_render']:>14}"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("splice", __doc__, SpliceBenchConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
