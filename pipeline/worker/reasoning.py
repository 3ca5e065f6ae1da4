"""Which vLLM reasoning parser serves a model: the one its template family writes for, or
the one named on the command line.

Light on purpose (vLLM is imported only to check a name), so the CLI can offer the flag
without loading the engine's libraries.
"""

from __future__ import annotations

AUTO = "auto"
NO_PARSER = "none"
FAMILY_REASONING_PARSERS: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "strip_reasoning": "qwen3",
    "deepseek_r1": "deepseek_r1",
}
"""The reasoning parser that fits a template family (a tiny model's, or config.json's
``model_type``): ``auto`` serves reasoning the way these models write it."""


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


__all__ = ["AUTO", "FAMILY_REASONING_PARSERS", "NO_PARSER", "reasoning_parser_for"]
