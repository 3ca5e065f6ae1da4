"""vLLM's renderer with the exact-prefix splice: the prompt is fixed before the engine sees it.

Every vLLM serving layer that speaks chat (Chat Completions, Responses, Anthropic
Messages) renders through ``preprocess_chat``, except for harmony-format models (gpt-oss),
whose Chat Completions and Responses vLLM renders with ``openai_harmony`` in methods of
their own (hooked here too); completions go through ``preprocess_completion``. This subclass lets vLLM render as usual, then, for a request
with a capture scope (``CURRENT_SCOPE``, set by the route), replaces the rendered ids by
the scope's spliced prompt and tags the engine input with the scope so the capturing
engine client knows whose call it is. Requests without a scope are untouched.
"""

from __future__ import annotations

from typing import Any

from vllm.renderers.hf import resolve_chat_template_kwargs
from vllm.renderers.online_renderer import OnlineRenderer, ResponsesRenderResult

from stages.capture.vllm.client import tag_engine_input
from stages.capture.vllm.scope import CURRENT_SCOPE, CaptureScope

PROMPT_IDS = "prompt_token_ids"


class CaptureRefused(ValueError):
    """A captured request vLLM would render into something that is not one token prompt."""


class CapturingRenderer(OnlineRenderer):  # type: ignore[misc]
    """``OnlineRenderer`` that splices and tags the prompt of a captured request."""

    async def preprocess_chat(
        self,
        request: Any,
        messages: list[Any],
        default_template: str | None,
        default_template_content_format: Any,
        default_template_kwargs: dict[str, Any] | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        conversation, engine_inputs = await super().preprocess_chat(
            request,
            messages,
            default_template,
            default_template_content_format,
            default_template_kwargs,
            *args,
            **kwargs,
        )
        scope = CURRENT_SCOPE.get()
        if scope is not None:
            tools = kwargs.get("tool_dicts", args[0] if args else None)
            params = request.build_chat_params(default_template, default_template_content_format)
            template_kwargs = _as_rendered(scope, params.with_defaults(default_template_kwargs))
            engine_input = _one_token_prompt(engine_inputs)
            # What vLLM rendered: its parsed conversation through a template, the request's
            # own messages through mistral_common.
            rendered = messages if scope.renderer.tokenizer_mode == "mistral" else conversation
            engine_input[PROMPT_IDS] = scope.splice_chat(
                rendered, tools, list(engine_input[PROMPT_IDS]), template_kwargs
            )
            tag_engine_input(engine_input, scope)
        return conversation, engine_inputs

    def _make_request_with_harmony(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """Chat Completions for gpt-oss: vLLM renders harmony messages itself, not through
        ``preprocess_chat``."""
        messages, engine_inputs = super()._make_request_with_harmony(request, *args, **kwargs)
        self._splice_harmony(messages, engine_inputs)
        return messages, engine_inputs

    def _render_responses_with_harmony(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """Responses for gpt-oss: the first engine request's prompt (a built-in tool's next
        turn is rendered elsewhere and goes to the engine untagged, uncaptured)."""
        result = super()._render_responses_with_harmony(request, *args, **kwargs)
        if isinstance(result, ResponsesRenderResult):
            self._splice_harmony(result.messages, [result.engine_input])
        return result

    def _splice_harmony(self, messages: list[Any], engine_inputs: list[Any]) -> None:
        scope = CURRENT_SCOPE.get()
        if scope is None:
            return
        engine_input = _one_token_prompt(engine_inputs)
        engine_input[PROMPT_IDS] = scope.splice_harmony(messages, list(engine_input[PROMPT_IDS]))
        tag_engine_input(engine_input, scope)

    async def preprocess_completion(
        self, request: Any, prompt_input: Any, prompt_embeds: Any, **kwargs: Any
    ) -> Any:
        engine_inputs = await super().preprocess_completion(request, prompt_input, prompt_embeds, **kwargs)
        scope = CURRENT_SCOPE.get()
        if scope is not None:
            engine_input = _one_token_prompt(engine_inputs)
            text = prompt_input if isinstance(prompt_input, str) else None
            engine_input[PROMPT_IDS] = scope.splice_tokens(list(engine_input[PROMPT_IDS]), self._decode, text)
            tag_engine_input(engine_input, scope)
        return engine_inputs

    def _decode(self, ids: list[int]) -> str:
        return str(self.renderer.tokenizer.decode(ids, skip_special_tokens=False))


def _as_rendered(scope: CaptureScope, params: Any) -> dict[str, Any]:
    """The template variables vLLM rendered the request with (its own kwargs, the server's
    defaults, ``reasoning_effort`` as ``enable_thinking``), filtered as vLLM filters them."""
    template = scope.renderer.template_text
    if template is None:
        return {}
    return dict(
        resolve_chat_template_kwargs(
            scope.renderer.tokenizer, template, params.chat_template_kwargs, raise_on_unexpected=False
        )
    )


def _one_token_prompt(engine_inputs: list[Any]) -> dict[str, Any]:
    if len(engine_inputs) != 1:
        raise CaptureRefused(f"a captured request must render to one prompt, not {len(engine_inputs)}")
    engine_input = engine_inputs[0]
    if not isinstance(engine_input, dict) or PROMPT_IDS not in engine_input:
        raise CaptureRefused("a captured request must render to token ids")
    return engine_input


__all__ = ["CaptureRefused", "CapturingRenderer"]
