"""jaxserve's Llama against transformers on the embedded GGUF, in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import full_forward, greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\nx = np.",
    "Le chat est",
    "1, 2, 3, 4, 5,",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clean code.",
    "Translate 'good morning' into Spanish.",
]
MAX_REL_ERR = 1e-4


def assert_close_rel(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Max absolute difference relative to the reference's largest magnitude."""
    err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    assert err <= MAX_REL_ERR, f"{what}: max relative error {err:.2e} > {MAX_REL_ERR}"


def test_hidden_states_and_logits_match_transformers(smollm, hf_model, hf_tokenizer):
    ids = hf_tokenizer("The capital of France is Paris, and the capital of Germany is").input_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True)
    out = full_forward(smollm, ids, return_hidden=True)
    # transformers' hidden_states: the embedding output, each layer's output, the last after the final norm.
    assert len(out.hidden_states) == smollm.config.num_layers
    for i, ours in enumerate(out.hidden_states):
        assert_close_rel(np.asarray(ours), ref.hidden_states[i].numpy(), f"input of layer {i}")
    assert_close_rel(np.asarray(out.logits), ref.logits.numpy(), "logits")


def _hf_greedy(hf_model, prompts: list[list[int]], max_new: int, eos: list[int]) -> list[list[int]]:
    """transformers' greedy continuations of the prompts, in one left-padded batch (its tokens for these prompts
    equal those of one generate call each, at a fifth of the time), each cut after its first end token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[0])
    rows = out[:, width:].tolist()
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


def test_greedy_continuations_equal_transformers(smollm, hf_model, hf_tokenizer):
    tok = smollm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    for chat, ids in zip(CHATS, prompts[len(PROMPTS):]):
        expected = hf_tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                                    tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert ids == list(expected), "chat template renders differently from transformers"
    max_new = 20
    ours = greedy(smollm, prompts, max_new)
    for prompt, output, expected in zip(prompts, ours, _hf_greedy(hf_model, prompts, max_new, list(tok.eos_token_ids))):
        assert output == expected, tok.decode(prompt)
    assert "Paris" in tok.decode(ours[0])
