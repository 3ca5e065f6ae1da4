"""``tokentrail make-tiny-model``: build the offline tiny model that tests and demos serve.

A verb of its own so a cluster or CI job can prepare the model once (it is idempotent)
before starting workers, instead of every worker racing to build it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.models import tekken
from pipeline.models.tiny import TEMPLATES, family
from pipeline.models.vocabularies import VOCABULARIES
from pipeline.process.flags import Flag, add_flags, from_flags

EXAMPLE = """\
example:
  tokentrail make-tiny-model /tmp/tiny --seed 0 --json
  tokentrail make-tiny-model /tmp/tiny-strip --template strip_reasoning
  tokentrail make-tiny-model /tmp/tiny-llama3 --template llama3
  tokentrail make-tiny-model /tmp/tiny-moe --moe
  tokentrail make-tiny-model /tmp/tiny-qwen3 --vocab qwen3
  tokentrail make-tiny-model /tmp/tiny-tekken --vocab mistral_tekken
"""


VOCABS = [*(vocab.name for vocab in VOCABULARIES), tekken.TEKKEN_VOCAB]


class TinyModelSettings(BaseModel):
    """Each field is a ``tokentrail make-tiny-model`` flag (here: ``pipeline.models`` sits
    below the flags' floor, and only this verb builds a model from flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    dir: Annotated[Path, Flag(positional=True, metavar="DIR")]
    """output directory"""
    seed: int = 0
    """weight seed"""
    vocab_size: Annotated[int | None, Field(ge=1)] = None
    """tokenizer vocabulary size"""
    template: Annotated[str, Flag(metavar="NAME", choices=TEMPLATES)] = Field(
        default="chatml",
        description="chat-template family, with its special tokens and stop tokens: "
        + "; ".join(f"{name}: {family(name).summary}" for name in TEMPLATES),
    )
    vocab: Annotated[str | None, Flag(metavar="NAME", choices=VOCABS)] = Field(
        default=None,
        description="a real model's vocabulary and that model's own chat template, read from the package that "
        "ships them (tokentrail's 'models' extra) instead of the trained toy vocabulary and --template: "
        + "; ".join(f"{vocab.name}: {vocab.summary}" for vocab in VOCABULARIES)
        + f"; {tekken.TEKKEN_VOCAB}: {tekken.SUMMARY} (tekken.json from mistral_common, no Jinja template: "
        "serve it with the worker's mistral tokenizer mode)",
    )
    moe: bool = False
    """a mixture-of-experts model instead (Qwen2-MoE architecture, 4 experts, top-2 routing)"""


def add_parser(subparsers: Any) -> None:
    """Register the ``make-tiny-model`` verb on the CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "make-tiny-model",
        help="create the tiny offline model (vLLM CPU and transformers compatible)",
        description=(
            "Create a tiny Llama-architecture causal LM (or, with --moe, a Qwen2-MoE; with --vocab gpt_oss, "
            "gpt-oss's own network) with seeded fp32 weights, a locally trained byte-level BPE tokenizer and a chat "
            "template (ChatML unless --template) in DIR. Offline and idempotent: an existing identical model is "
            "left as it is."
        ),
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, TinyModelSettings)
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Build the model and report where it is; exit 1 if DIR holds something else."""
    from pipeline.models import tiny as tinymodel

    settings = from_flags(TinyModelSettings, args)
    out_dir = settings.dir
    existed = tinymodel.read_manifest(out_dir) is not None
    options: dict[str, Any] = {
        "seed": settings.seed,
        "template": settings.template,
        "experts": 4 if settings.moe else 0,
        "vocab": settings.vocab or "",
    }
    if settings.vocab_size is not None:
        options["vocab_size"] = settings.vocab_size
    try:
        tinymodel.make_tiny_model(out_dir, **options)
    except (FileExistsError, ValueError) as exc:
        print(f"make-tiny-model: {exc}", file=sys.stderr)
        return 1
    report = tinymodel.tiny_model_report(out_dir, created=not existed)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        verb = "created" if report["created"] else "already present"
        print(f"tiny model {verb} in {report['model_dir']}")
    return 0
