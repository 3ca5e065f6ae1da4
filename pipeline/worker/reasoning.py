"""Which vLLM parsers serve a model: the ones its template family writes for, or the ones
named on the command line.

Light on purpose (vLLM is imported only to check a name), so the CLI can offer the flags
without loading the engine's libraries.
"""

from __future__ import annotations

from pipeline.worker.tokenizer_mode import HF, MISTRAL

AUTO = "auto"
NO_PARSER = "none"
FAMILY_REASONING_PARSERS: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "strip_reasoning": "qwen3",
    "deepseek_r1": "deepseek_r1",
    "gptoss": "openai_gptoss",
    "gpt_oss": "openai_gptoss",
}
"""The reasoning parser that fits a template family (a tiny model's, or config.json's
``model_type``): ``auto`` serves reasoning the way these models write it."""
DEFAULT_TOOL_PARSER = "hermes"
"""``<tool_call>{json}</tool_call>``: what the tiny models' templates write and most open
chat models use."""
MISTRAL_TOOL_PARSER = "mistral"
"""vLLM's parser of ``[TOOL_CALLS]``, what models served through mistral_common write."""
FAMILY_TOOL_PARSERS: dict[str, str] = {"gptoss": "openai", "gpt_oss": "openai"}
"""Families whose replies another tool parser reads. vLLM parses gpt-oss's harmony replies
(channels, ``to=functions.NAME`` recipients) with ``openai`` and refuses any other."""


def reasoning_parser_for(choice: str, family: str) -> str | None:
    """``--reasoning-parser``: ``auto`` (the family's parser, if it reasons), ``none``, or
    one of vLLM's parsers by name; raises ``ValueError`` listing them for any other name."""
    if choice == AUTO:
        return FAMILY_REASONING_PARSERS.get(family)
    if choice == NO_PARSER:
        return None
    from vllm.reasoning import ReasoningParserManager

    known = sorted(ReasoningParserManager.list_registered())
    if choice not in known:
        raise ValueError(
            f"reasoning-parser: unknown {choice!r}; {AUTO}, {NO_PARSER} or one of vLLM's: {', '.join(known)}"
        )
    return choice


def tool_parser_for(choice: str | None, family: str, tokenizer_mode: str = HF) -> str | None:
    """``--tool-call-parser``: ``auto`` (``mistral`` for a model served through mistral_common,
    which writes ``[TOOL_CALLS]``; else the family's parser, else ``hermes``), None (off), or a
    vLLM parser by name (vLLM checks the name when it builds the parser)."""
    if choice == AUTO:
        if tokenizer_mode == MISTRAL:
            return MISTRAL_TOOL_PARSER
        return FAMILY_TOOL_PARSERS.get(family, DEFAULT_TOOL_PARSER)
    return choice


__all__ = [
    "AUTO",
    "DEFAULT_TOOL_PARSER",
    "FAMILY_REASONING_PARSERS",
    "FAMILY_TOOL_PARSERS",
    "MISTRAL_TOOL_PARSER",
    "NO_PARSER",
    "reasoning_parser_for",
    "tool_parser_for",
]
