"""Every setting of one ``tokentrail worker`` process, written once.

The verb's flags, their help and any command line that starts a worker come from this
model (``pipeline.process.flags``); the Kafka connection, the credentials and the log
format travel with their own flags (``pipeline.kafka.config``, ``pipeline.auth.arguments``,
``pipeline.process.jsonlog``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.dataplane.config import AddressesFlag
from pipeline.process.flags import Flag
from pipeline.worker import DEFAULT_MAX_BODY_BYTES, MaxBodyBytes
from pipeline.worker.reasoning import AUTO, NO_PARSER, reasoning_parser_for
from pipeline.worker.tokenizer_mode import TOKENIZER_MODES, resolve_tokenizer_mode
from stages.capture.retain import DEFAULT_BUDGET_BYTES
from stages.recent import DEFAULT_REMEMBER

if TYPE_CHECKING:
    from pipeline.auth.credentials import Credentials
    from pipeline.auth.transport import TlsFiles
    from pipeline.worker.main import WorkerConfig

ENGINE = "engine"


def read_template(path: str) -> str:
    """``--chat-template FILE``: the template's text, read once when the flag is parsed."""
    return Path(path).read_text()


class WorkerSettings(BaseModel):
    """What one worker serves, and how it captures; each field is a ``tokentrail worker`` flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    engine: Literal["vllm"] = "vllm"
    """inference engine"""
    model_dir: Annotated[Path, Flag("--model", metavar="DIR")]
    """model directory"""
    host: str = "127.0.0.1"
    """listen address"""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """listen port; 0 picks a free one"""
    ack: Literal["staged", "enqueued"] = "staged"
    """reply after the row is staged, or as soon as it is queued"""
    worker_id: str | None = None
    """id in staged events (default: worker-HOST-PID)"""
    served_model_name: str | None = None
    """model name in replies (default: the directory name)"""
    weight_version: Annotated[int, Field(ge=0)] = 0
    """initial weight version"""
    span_policy: Literal["record", "reject"] = "record"
    """calls straddling a refit: record their version spans, or fail their capture"""
    logprob_path: Literal["sampled", "vllm"] = "sampled"
    """sampled: the engine's sampler takes the sampled token's logprob directly, and captured
    calls whose client asked for no logprobs keep that float only; vllm: vLLM's whole logprob path"""
    prefix_wait_s: Annotated[float, Field(ge=0)] = 5.0
    """bound on waiting for a parent row"""
    max_body_bytes: MaxBodyBytes = DEFAULT_MAX_BODY_BYTES
    retain_bytes: Annotated[int, Field(ge=0), Flag(metavar="N")] = Field(
        default=DEFAULT_BUDGET_BYTES,
        description=(
            "staged rows kept until their rollout is finalized, to stage again into a data plane that "
            f"restarted (default: {DEFAULT_BUDGET_BYTES}, 256 MiB); rows beyond it are lost with the data plane"
        ),
    )
    remember: Annotated[int, Field(ge=0), Flag(metavar="N")] = DEFAULT_REMEMBER
    """finalized rollouts recognised after their rows were let go, so a row of theirs staged
    late is deleted at once"""
    chat_template: Annotated[str | None, Flag(metavar="FILE", parse=read_template)] = None
    """chat template overriding the tokenizer's, for serving and the exact-prefix splice"""
    template_family: Annotated[str | None, Flag(metavar="NAME")] = None
    """the template's name in splice-failure logs and metrics (default: what the model records,
    or 'custom' with --chat-template)"""
    tokenizer_mode: Annotated[str, Flag(choices=TOKENIZER_MODES)] = AUTO
    """how chat requests become tokens: mistral: with mistral_common, as vLLM serves Mistral models
    (tekken.json); auto: mistral where that is the model's only chat format (a mistral_common
    tokenizer file and no Hugging Face tokenizer, or Mistral's consolidated weights), else the
    chat template"""
    tool_call_parser: str = AUTO
    """vLLM tool parser for tool calls in replies; auto: mistral under mistral_common, else the one
    that fits the model's template family (openai for gpt-oss's harmony format), else hermes;
    'none' turns tool parsing off"""
    reasoning_parser: Annotated[str, Flag(metavar="NAME")] = AUTO
    """vLLM reasoning parser for reasoning in replies (reasoning_content, reasoning items, thinking
    blocks); auto: the one that fits the model's template family (qwen3, deepseek_r1,
    openai_gptoss), if it reasons; none: off"""
    dtype: Annotated[str, Flag(group=ENGINE)] = "float32"
    """weights and activations"""
    max_model_len: Annotated[int, Field(ge=1), Flag(group=ENGINE)] = 4096
    """longest prompt plus generation, in tokens"""
    kv_cache_bytes: Annotated[int, Field(ge=1), Flag(group=ENGINE)] = 64 * 2**20
    """KV cache size in bytes"""
    seed: Annotated[int, Flag(group=ENGINE)] = 0
    """engine seed"""
    dataplane_addresses: AddressesFlag = None

    def worker_config(
        self, credentials: Credentials, *, tls: TlsFiles | None = None, insecure_no_auth: bool = False
    ) -> WorkerConfig:
        """The worker process's configuration. Refuses (``ValueError``) a model it could not
        serve as configured, before the engine starts rather than a minute later."""
        from pipeline.worker.main import WorkerConfig, default_worker_id  # vLLM: only once a worker starts
        from stages.capture.core import AckPolicy
        from stages.capture.vllm.client import LogprobPath, SpanPolicy
        from stages.capture.vllm.engine import EngineSettings

        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a model directory (no config.json)")
        reasoning_parser_for(self.reasoning_parser, "")
        mode = resolve_tokenizer_mode(self.model_dir, self.tokenizer_mode, chat_template=self.chat_template)
        return WorkerConfig(
            model_dir=self.model_dir,
            worker_id=self.worker_id or default_worker_id(),
            ack_policy=AckPolicy(self.ack),
            host=self.host,
            port=self.port,
            served_model_name=self.served_model_name,
            weight_version=self.weight_version,
            span_policy=SpanPolicy(self.span_policy),
            logprob_path=LogprobPath(self.logprob_path),
            prefix_wait_s=self.prefix_wait_s,
            max_body_bytes=self.max_body_bytes,
            retain_bytes=self.retain_bytes,
            remember=self.remember,
            chat_template=self.chat_template,
            template_family=self.template_family,
            tokenizer_mode=self.tokenizer_mode,
            tool_parser=None if self.tool_call_parser == NO_PARSER else self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            credentials=credentials,
            insecure_no_auth=insecure_no_auth,
            tls=tls,
            engine=EngineSettings(
                model=str(self.model_dir),
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                kv_cache_memory_bytes=self.kv_cache_bytes,
                seed=self.seed,
                tokenizer_mode=mode,
                sampled_logprob_sampler=self.logprob_path == "sampled",
            ),
        )
