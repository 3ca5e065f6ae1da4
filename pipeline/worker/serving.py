"""vLLM's own serving layers, built around the capturing engine client and renderer.

The worker serves Chat Completions, Completions, Responses and Anthropic Messages with
vLLM's implementations (templates, tool and reasoning parsers, streaming, ``n``,
logprobs, structured outputs); capture attaches through the two objects they share:
the renderer (``CapturingRenderer``: the exact-prefix splice) and the engine client
(``CapturingEngineClient``: each finished choice becomes a row). Tool calls are parsed
with the parser that fits the model: vLLM's ``mistral`` parser (``[TOOL_CALLS]``) for a model
served through mistral_common, ``openai`` for gpt-oss's harmony format, else ``hermes``
(``<tool_call>{json}</tool_call>``, what most open chat models write), or the one
``--tool-call-parser`` names. Reasoning is parsed out of replies
(``reasoning_content``, Responses reasoning items, Messages thinking blocks) with the
parser that fits the model's template family, or the one ``--reasoning-parser`` names;
capture is not affected: the row holds every generated token, reasoning included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

from stages.capture.vllm.client import CapturingEngineClient
from stages.capture.vllm.renderer import CapturingRenderer


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """How vLLM renders and parses; ``chat_template`` overrides the tokenizer's."""

    model_name: str
    model_path: str
    chat_template: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass(frozen=True, slots=True)
class Serving:
    """One handler per protocol, all on one capturing client and renderer."""

    models: Any
    renderer: CapturingRenderer
    chat: Any
    completion: Any
    responses: Any
    messages: Any


def build_serving(client: CapturingEngineClient, options: ServingOptions) -> Serving:
    models = OpenAIServingModels(
        engine_client=client,
        base_model_paths=[BaseModelPath(name=options.model_name, model_path=options.model_path)],
    )
    auto_tools = options.tool_parser is not None
    renderer = CapturingRenderer(
        model_config=client.model_config,
        renderer=client.renderer,
        request_logger=None,
        chat_template=options.chat_template,
        chat_template_content_format="auto",
        enable_auto_tools=auto_tools,
        tool_parser=options.tool_parser,
        reasoning_parser=options.reasoning_parser,
    )
    renderer.warmup()
    chat_like: dict[str, Any] = {
        "online_renderer": renderer,
        "request_logger": None,
        "chat_template": options.chat_template,
        "chat_template_content_format": "auto",
        "enable_auto_tools": auto_tools,
        "tool_parser": options.tool_parser,
        "reasoning_parser": options.reasoning_parser or "",
    }
    return Serving(
        models=models,
        renderer=renderer,
        chat=OpenAIServingChat(client, models, "assistant", **chat_like),
        completion=OpenAIServingCompletion(client, models, online_renderer=renderer, request_logger=None),
        responses=OpenAIServingResponses(client, models, **chat_like),
        messages=AnthropicServingMessages(client, models, "assistant", **chat_like),
    )


__all__ = ["Serving", "ServingOptions", "build_serving"]
