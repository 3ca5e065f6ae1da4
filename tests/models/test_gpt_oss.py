"""gpt-oss (the harmony format) on a tiny model: its vocabulary, and its calls captured exactly.

The vocabulary is proven on plain text with the others (``test_vocabularies``); here its
special tokens are checked against harmony's own encoding, which is what vLLM renders
gpt-oss prompts and parses its replies with.
"""

from __future__ import annotations

from pipeline.models.vocabularies import load_tokenizer, vocabulary


def test_harmonys_special_tokens_sit_at_harmonys_ids() -> None:
    """Every special token of the built vocabulary is harmony's token of that id, the control
    tokens the format is made of included; quicktok and tiktoken name 200018
    ``<|endofprompt|>`` where harmony keeps it reserved (neither format writes it)."""
    import openai_harmony

    harmony = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    tokenizer = load_tokenizer(vocabulary("gpt_oss"))
    added = tokenizer.get_added_tokens_decoder()
    assert sorted(added) == list(range(199_998, 201_088))
    differing = {
        token_id: token.content
        for token_id, token in added.items()
        if harmony.encode(token.content, allowed_special="all") != [token_id]
    }
    assert differing == {200_018: "<|endofprompt|>"}
    assert all(token.special for token in added.values())
    control = {
        "<|return|>": 200_002,
        "<|constrain|>": 200_003,
        "<|channel|>": 200_005,
        "<|start|>": 200_006,
        "<|end|>": 200_007,
        "<|message|>": 200_008,
        "<|call|>": 200_012,
    }
    assert {name: tokenizer.token_to_id(name) for name in control} == control
    assert set(harmony.stop_tokens_for_assistant_actions()) == {200_002, 200_012}
