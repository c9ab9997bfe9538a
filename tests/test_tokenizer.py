"""The GGUF-built tokenizer against transformers' tokenizer of the same file."""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.errors import InputError

CORPUS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Unicode: naïve café, Zürich, São Paulo, Ångström, ½ → ∞",
    "Emoji: 🚀🔥 👩‍👩‍👧‍👦 🇫🇷 and 😀😃😄",
    "CJK: 日本語のテキスト, 中文文本, 한국어 텍스트",
    "Arabic and Hebrew: مرحبا بالعالم שלום עולם",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "numbers 1234567890 3.14159 -42 1e-10 0xFF",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's I'm you'll they've we'd",
    "whitespace runs:          \n\t\t\t   \n",
    "",
]


@pytest.mark.parametrize("text", CORPUS)
def test_encode_equals_transformers(smollm, hf_tokenizer, text):
    assert smollm.tokenizer.encode(text) == hf_tokenizer(text).input_ids


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(smollm, hf_tokenizer, text):
    ids = smollm.tokenizer.encode(text)
    assert smollm.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_detokenization_equals_full_decode(smollm, text):
    ids = smollm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm.tokenizer, skip_special_tokens=False)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == smollm.tokenizer.decode(ids, skip_special_tokens=False)
    assert not any("\ufffd" in d for d in deltas), "a delta carried half a character"


def test_emoji_split_across_tokens_is_held_back(smollm):
    ids = smollm.tokenizer.encode("🚀")
    assert len(ids) > 1, "the test needs a character spread over several byte tokens"
    detok = IncrementalDetokenizer(smollm.tokenizer)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🚀"


def test_flush_gives_a_character_cut_short_as_a_replacement_character(smollm):
    ids = smollm.tokenizer.encode("Go 🚀")
    detok = IncrementalDetokenizer(smollm.tokenizer)
    text = "".join(detok.push(i) for i in ids[:-1])
    assert text == "Go" and detok.flush() == smollm.tokenizer.decode(ids[:-1])[len(text):] == " \ufffd"
    assert detok.flush() == ""


def test_special_tokens_are_single_ids(smollm):
    tok = smollm.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.eos_token_ids == (2,)


def test_chat_template_renders_like_transformers(smollm, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    ours = smollm.tokenizer.render_chat(messages)
    assert ours == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.endswith("<|im_start|>assistant\n")


def test_chat_template_runs_sandboxed(smollm):
    from dataclasses import replace

    evil = replace(smollm.tokenizer, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InputError, match="chat template"):
        evil.render_chat([{"role": "user", "content": "x"}])
