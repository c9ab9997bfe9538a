"""GGUF files of every family that llama.cpp converts, written by llama.cpp's own convert_hf_to_gguf.py
(tests/fixtures/gguf/make_fixtures.py; the same structural options as tests/test_families.py where llama.cpp has
them), against what transformers computed from the same weights: the logits at every position of a prompt and its
32 greedy tokens (each position's logits as generation computed them), so each position's most likely token is
the next greedy one."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve.checkpoint import load_model
from tests.helpers import logits_of

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "gguf")
FAMILIES = {"qwen3": {"qk_norm": True}, "qwen2": {"attention_bias": True},
            "gemma2": {"sliding_window": 8, "local_layers": (0,), "attn_softcap": 0.5,
                       "final_softcap": float(np.float32(0.4))},  # as GGUF stores it
            "gemma3": {"sliding_window": 8, "local_layers": (0, 1, 2, 3, 4), "local_rope_theta": 10000.0},
            "phi3": {"sliding_window": 6, "rope_scaling": "longrope"},
            "mixtral": {"num_experts": 8, "experts_per_token": 2}, "qwen3_moe": {"num_experts": 8, "qk_norm": True}}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_conversions_give_the_logits_and_greedy_tokens_of_transformers(name):
    model = load_model(os.path.join(FIXTURES, f"{name}.gguf"), dtype="float32")
    switches = model.config.switches
    assert model.config.architecture == name
    assert {k: switches.get(k) for k in FAMILIES[name]} == FAMILIES[name]
    expected = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    ids, prompt_len, ref = expected["ids"].tolist(), int(expected["prompt_len"]), expected["logits"]
    ours = logits_of(model, ids)[:-1]
    err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    assert err <= 1e-4, f"max relative error {err:.2e}"
    assert np.argmax(ours[prompt_len - 1:], axis=-1).tolist() == ids[prompt_len:]


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_sentencepiece_tokenizers_encode_as_transformers_reads_them(name):
    """SentencePiece ('llama') GGUF tokenizers, with the space prefix (Phi-3) and without (Gemma 3): the ids of
    transformers' tokenizer of the same file (BOS first, bytes past the vocabulary as <0xNN> pieces), and back."""
    from transformers import AutoTokenizer

    ours = load_model(os.path.join(FIXTURES, f"{name}.gguf")).tokenizer
    theirs = AutoTokenizer.from_pretrained(FIXTURES, gguf_file=f"{name}.gguf")
    for text in ["the quick brown fox", "Hello world, jaxserve serves models.", "new\nline ü ✓ 123"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids[1:]) == text
