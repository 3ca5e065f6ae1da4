"""Does vLLM return the experts it routed each token to, for a tiny MoE model? A prepared check.

Not a pytest module. From the repository root:

    python tests/gpu/moe_routed_experts.py --json

It builds the tiny mixture-of-experts model (``make-tiny-model --moe``: Qwen2-MoE, 2
layers, 4 experts, top-2), serves it with vLLM's ``enable_return_routed_experts``, and
generates greedily for two prompts. Each choice's ``routed_experts`` must be an integer
array ``[prompt + generated - 1, layers, 2]`` (the last generated token is never run
through the model), and for every position a Hugging Face forward of the same model over
the same ids must select the same experts (top-2 of the router's softmax).

On the CPU build this project pins, vLLM refuses the option: it needs Model Runner V2,
which needs Triton with a CPU backend. The report then carries that error, and the check
exits 1. Routed-experts capture (router replay) is blocked on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

PROMPTS = ([10, 11, 12, 13, 14], [10, 11, 12, 13, 14, 15, 16, 17])
MAX_TOKENS = 4


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    report: dict[str, Any] = {"ok": False}
    try:
        report.update(check(Path(tempfile.mkdtemp(prefix="tiny-moe-")) / "model"))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc(limit=6)
    print(json.dumps(report, indent=None if args.json else 2, sort_keys=True))
    return 0 if report["ok"] else 1


def check(model_dir: Path) -> dict[str, Any]:
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.models.tiny import make_tiny_model

    make_tiny_model(model_dir, seed=0, experts=4)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        seed=0,
        enable_return_routed_experts=True,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    results = []
    for prompt in PROMPTS:
        choice = llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)[0].outputs[0]
        routed = np.asarray(choice.routed_experts)
        expected = hf_experts(model_dir, [*prompt, *choice.token_ids])[
            : len(prompt) + len(choice.token_ids) - 1
        ]
        results.append(
            {
                "prompt_len": len(prompt),
                "generated": len(choice.token_ids),
                "shape": list(routed.shape),
                "dtype": str(routed.dtype),
                "matches_hf": routed.shape == expected.shape
                and bool(np.array_equal(np.sort(routed.astype(np.int64), -1), np.sort(expected, -1))),
            }
        )
    return {"ok": all(r["matches_hf"] for r in results), "requests": results}


def hf_experts(model_dir: Path, ids: list[int]) -> Any:
    """``[tokens, layers, 2]``: the top-2 experts of every layer's router, per position."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    logits: dict[int, Any] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, j=j: logits.__setitem__(j, out))
        for j, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    per_layer = []
    for j in range(len(model.model.layers)):
        raw = logits[j][0] if isinstance(logits[j], tuple) else logits[j]
        per_layer.append(torch.topk(torch.softmax(raw.float(), -1), 2, -1).indices.numpy())
    return np.stack(per_layer, axis=1)


if __name__ == "__main__":
    sys.exit(main())
