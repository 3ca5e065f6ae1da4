"""``tokentrail worker``: serve a model with capture on an OpenAI-compatible endpoint.

The worker publishes staged events to Kafka (``--bootstrap``) and writes rows to a
data plane it attaches to: the one whose addresses ``--dataplane-addresses`` names,
else the one ``TOKENTRAIL_DATAPLANE_*`` points at (see ``tokentrail dataplane``). It
serves until SIGTERM or SIGINT, then finishes in-flight requests, drains its staging
writer and shuts the engine down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiokafka.errors import KafkaError

from pipeline.auth.arguments import add_auth_arguments, credentials_from_args, tls_from_args
from pipeline.dataplane.config import add_dataplane_addresses_argument
from pipeline.kafka.config import ConfigError, add_kafka_arguments, config_from_args
from pipeline.process.guard import guard_descendants
from pipeline.process.jsonlog import add_log_format_argument, configure_logging, vllm_logging
from pipeline.worker import add_body_limit_argument
from pipeline.worker.reasoning import AUTO, reasoning_parser_for
from pipeline.worker.tokenizer_mode import TOKENIZER_MODES, resolve_tokenizer_mode
from stages.capture.retain import DEFAULT_BUDGET_BYTES
from stages.ports import DataPlaneError

if TYPE_CHECKING:
    from pipeline.worker.main import WorkerConfig

EXAMPLES = """\
examples:
  tokentrail make-tiny-model /tmp/tiny
  tokentrail dataplane --data-dir runs/exp1 &
  tokentrail worker --engine vllm --model /tmp/tiny --port 8100 \\
      --bootstrap 127.0.0.1:9092 --dataplane-addresses runs/exp1/dataplane.json
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "worker",
        help="serve a model with token capture (OpenAI and Anthropic APIs, through vLLM)",
        description=(
            "Start an inference engine and serve vLLM's /v1/chat/completions, /v1/completions, "
            "/v1/responses and /v1/messages with capture: requests carrying ng_capture are "
            "recorded token-exact, staged to the data plane and announced on Kafka. Refit "
            "through /admin/* or vLLM's RL endpoints; metrics on /metrics."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--engine", choices=("vllm",), default="vllm", help="inference engine (default: vllm)"
    )
    parser.add_argument("--model", type=Path, required=True, metavar="DIR", help="model directory")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8000, help="listen port; 0 picks a free one (default: 8000)"
    )
    parser.add_argument(
        "--ack",
        choices=("staged", "enqueued"),
        default="staged",
        help="reply after the row is staged, or as soon as it is queued (default: staged)",
    )
    parser.add_argument("--worker-id", help="id in staged events (default: worker-HOST-PID)")
    parser.add_argument("--served-model-name", help="model name in replies (default: the directory name)")
    parser.add_argument("--weight-version", type=int, default=0, help="initial weight version (default: 0)")
    parser.add_argument(
        "--span-policy",
        choices=("record", "reject"),
        default="record",
        help="calls straddling a refit: record their version spans, or fail their capture",
    )
    parser.add_argument(
        "--logprob-path",
        choices=("sampled", "vllm"),
        default="sampled",
        help="sampled: the engine's sampler takes the sampled token's logprob directly, and "
        "captured calls whose client asked for no logprobs keep that float only; vllm: vLLM's "
        "whole logprob path (default: sampled)",
    )
    parser.add_argument("--prefix-wait-s", type=float, default=5.0, help="bound on waiting for a parent row")
    add_body_limit_argument(parser)
    parser.add_argument(
        "--retain-bytes",
        type=int,
        default=DEFAULT_BUDGET_BYTES,
        metavar="N",
        help=(
            "staged rows kept until their rollout is finalized, to stage again into a data plane "
            "that restarted (default: %(default)s, 256 MiB); rows beyond it are lost with the data plane"
        ),
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="chat template overriding the tokenizer's, for serving and the exact-prefix splice",
    )
    parser.add_argument(
        "--template-family",
        metavar="NAME",
        help="the template's name in splice-failure logs and metrics (default: what the model "
        "records, or 'custom' with --chat-template)",
    )
    parser.add_argument(
        "--tokenizer-mode",
        choices=TOKENIZER_MODES,
        default=AUTO,
        help="how chat requests become tokens: mistral: with mistral_common, as vLLM serves Mistral models "
        "(tekken.json); auto: mistral where that is the model's only chat format (a mistral_common tokenizer "
        "file and no Hugging Face tokenizer, or Mistral's consolidated weights), else the chat template "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=AUTO,
        help="vLLM tool parser for tool calls in replies; auto: mistral under mistral_common, else the one "
        "that fits the model's template family (openai for gpt-oss's harmony format), else hermes; 'none' turns "
        "tool parsing off (default: %(default)s)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=AUTO,
        metavar="NAME",
        help="vLLM reasoning parser for reasoning in replies (reasoning_content, reasoning items, thinking "
        "blocks); auto: the one that fits the model's template family (qwen3, deepseek_r1, openai_gptoss), "
        "if it reasons; none: off (default: %(default)s)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="float32", help="weights and activations (default: %(default)s)")
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="longest prompt plus generation, in tokens (default: %(default)s)",
    )
    engine.add_argument("--kv-cache-bytes", type=int, default=64 * 2**20, help="KV cache size in bytes")
    engine.add_argument("--seed", type=int, default=0, help="engine seed")
    add_dataplane_addresses_argument(parser)
    add_kafka_arguments(parser, bootstrap_required=True)
    add_auth_arguments(parser, server=True, client=False)
    parser.add_argument("--json", action="store_true", help="print one JSON document once serving")
    add_log_format_argument(parser)
    parser.set_defaults(run=run)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    from pipeline.worker.main import WorkerConfig, default_worker_id
    from stages.capture.core import AckPolicy
    from stages.capture.vllm.client import LogprobPath, SpanPolicy
    from stages.capture.vllm.engine import EngineSettings

    chat_template = None if args.chat_template is None else args.chat_template.read_text()
    return WorkerConfig(
        model_dir=args.model,
        worker_id=args.worker_id or default_worker_id(),
        ack_policy=AckPolicy(args.ack),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        weight_version=args.weight_version,
        span_policy=SpanPolicy(args.span_policy),
        logprob_path=LogprobPath(args.logprob_path),
        prefix_wait_s=args.prefix_wait_s,
        max_body_bytes=args.max_body_bytes,
        retain_bytes=args.retain_bytes,
        chat_template=chat_template,
        template_family=args.template_family,
        tokenizer_mode=args.tokenizer_mode,
        tool_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        credentials=credentials_from_args(args),
        insecure_no_auth=args.insecure_no_auth,
        tls=tls_from_args(args),
        engine=EngineSettings(
            model=str(args.model),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            kv_cache_memory_bytes=args.kv_cache_bytes,
            seed=args.seed,
            tokenizer_mode=resolve_tokenizer_mode(
                args.model, args.tokenizer_mode, chat_template=chat_template
            ),
            sampled_logprob_sampler=args.logprob_path == "sampled",
        ),
    )


def run(args: argparse.Namespace) -> int:
    # stdout carries only this verb's own report; vLLM logs to stderr in our format.
    configure_logging(args.log_format)
    vllm_logging(args.log_format, level="INFO")
    if not (args.model / "config.json").is_file():
        print(f"tokentrail worker: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:  # before the engine starts: a usage error, not a minute later
        reasoning_parser_for(args.reasoning_parser, "")
        config = worker_config(args)  # resolves the tokenizer mode: a model it cannot capture is refused
    except ValueError as exc:
        print(f"tokentrail worker: {exc}", file=sys.stderr)
        return 2
    from pipeline.worker.foreground import serve_worker  # vLLM: imported once a worker starts

    guard_descendants()  # the engine's processes die with the worker
    try:
        kafka = config_from_args(args)
        asyncio.run(serve_worker(config, kafka, args.dataplane_addresses, as_json=args.json))
    except (ConfigError, DataPlaneError, KafkaError, ValueError, OSError) as exc:
        print(f"tokentrail worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
