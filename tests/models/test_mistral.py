"""Mistral models as vLLM serves them by default: Tekken, conversations encoded by mistral_common.

The tiny model (``make-tiny-model --vocab mistral_tekken``) carries the Tekken file
mistral_common ships and no Hugging Face tokenizer. First the file as vLLM's mistral
tokenizer loads it is proved to encode as mistral_common's own ``Tekkenizer`` does, and a
Hugging Face forward (which needs only ids) to be usable as the oracle.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from vocabkit import diverse_strings

from pipeline.models.tekken import TEKKEN_FILE, TEKKEN_VOCAB, tekken_source, tekkenizer
from pipeline.models.tiny import make_tiny_model, read_manifest

USER = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tekken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed-0 tiny Llama on Mistral NeMo's Tekken."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tekken", vocab=TEKKEN_VOCAB)


def test_the_model_directory_holds_tekken_and_records_it(tekken_dir: Path) -> None:
    import json

    manifest = read_manifest(tekken_dir)
    assert manifest is not None and manifest["spec"]["vocab"] == TEKKEN_VOCAB
    assert (tekken_dir / TEKKEN_FILE).read_bytes() == tekken_source().read_bytes()
    assert (
        not (tekken_dir / "tokenizer.json").exists() and not (tekken_dir / "tokenizer_config.json").exists()
    )
    reference = tekkenizer()
    config = json.loads((tekken_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (reference.bos_id, reference.eos_id)
    assert config["vocab_size"] == reference.n_words == manifest["model_vocab_size"]
    generation = json.loads((tekken_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == manifest["eos_token_ids"] == [reference.eos_id]
    (tekken_dir / TEKKEN_FILE).rename(tekken_dir / "moved.json")
    try:
        assert read_manifest(tekken_dir) is None  # without its tokenizer the model is incomplete
    finally:
        (tekken_dir / "moved.json").rename(tekken_dir / TEKKEN_FILE)


def test_vllm_s_mistral_tokenizer_encodes_the_file_as_mistral_common_does(tekken_dir: Path) -> None:
    """What the engine serves through (vLLM's ``MistralTokenizer`` on the copied file) against
    mistral_common's ``Tekkenizer`` on the file the package ships, on 3,000 diverse strings."""
    from vllm.tokenizers.mistral import MistralTokenizer

    served = MistralTokenizer.from_pretrained(str(tekken_dir))
    reference = tekkenizer()
    strings = diverse_strings()
    differing = [
        text
        for text in strings
        if served.encode(text, add_special_tokens=False) != reference.encode(text, bos=False, eos=False)
    ]
    assert not differing, f"{len(differing)} of {len(strings)} differ; first: {differing[0]!r}"
    assert (served.bos_token_id, served.eos_token_id) == (reference.bos_id, reference.eos_id)
    assert served.encode("Hi", add_special_tokens=True)[0] == reference.bos_id


def test_transformers_alone_would_lose_bos_eos_and_the_chat_format(tekken_dir: Path) -> None:
    """Why the worker serves such a directory through mistral_common: the tokenizer
    transformers converts from the Tekken file has no BOS, no EOS and no chat template."""
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(tekken_dir))
    assert converted.bos_token_id is None and converted.eos_token_id is None
    assert not getattr(converted, "chat_template", None)


def test_a_hugging_face_forward_is_the_oracle_on_ids_alone(tekken_dir: Path) -> None:
    """The oracle loads weights and config only: a forward over the ids mistral_common
    encodes gives a distribution over the whole Tekken vocabulary at every position."""
    from enginekit import HFOracle
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from vllm.tokenizers.mistral import MistralTokenizer

    served = MistralTokenizer.from_pretrained(str(tekken_dir))
    ids = served.mistral.encode_chat_completion(ChatCompletionRequest.from_openai(USER)).tokens
    log_probs = HFOracle().log_softmax(tekken_dir, ids)
    assert tuple(log_probs.shape) == (len(ids), tekkenizer().n_words)
    for row in log_probs:
        assert math.isclose(float(row.exp().sum()), 1.0, abs_tol=1e-4)
