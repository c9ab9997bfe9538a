"""Models in real shapes with random weights, for speed work where no checkpoint can travel.

`load_model("random:llama3-8b")` gives an 8B-shaped Llama 3 (32 layers, d 4096, FFN 14336, 32 query /
8 KV heads, vocabulary 128256) with fan-in-scaled normal weights (also Qwen3-8B, Gemma-3-12B and Qwen3-30B-A3B
shapes, each with its family's switches) and a word-level tokenizer whose
tokens are `<0>`, `<1>`, ... over the whole vocabulary: every id decodes, nothing means anything.
Throughput and latency of such a model equal a trained one's of the same shape; its text does not.
"""

from __future__ import annotations

from typing import Any

import tokenizers

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.errors import CheckpointError
from jaxserve.model.config import ModelConfig, RopeScaling

PREFIX = "random:"
PRESETS = {
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                             max_position_embeddings=8192),
    "llama3-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                             num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                             max_position_embeddings=8192, tie_word_embeddings=True),
    # the embedded model's shapes (SmolLM2-135M: 30 layers, d 576, 9 query / 3 KV heads of 64), which cannot travel
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "smoke": ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=4096),
    # the families' speed shapes, from their config.json (jaxserve.checkpoint.hf_config's switches)
    "qwen3-8b": ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True),
    "gemma3-12b": ModelConfig(architecture="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                              num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, rope_scaling=RopeScaling(kind="linear", factor=8.0),
                              max_position_embeddings=131072, tie_word_embeddings=True, qk_norm=True,
                              sliding_window=1024, local_layers=tuple(i for i in range(48) if (i + 1) % 6),
                              local_rope_theta=10000.0, activation="gelu_tanh", embed_scale=True, sandwich_norm=True,
                              query_pre_attn_scalar=256.0),
    "qwen3-30b-a3b": ModelConfig(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                                 rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True, num_experts=128,
                                 experts_per_token=8, moe_intermediate_size=768, norm_topk_prob=True),
}


def preset(path: str) -> ModelConfig:
    """The config named by `random:NAME`; a clear error for an unknown name."""
    name = path[len(PREFIX):]
    if name not in PRESETS:
        raise CheckpointError(f"unknown random model {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """Word-level tokens `<i>` for every id; the last id is the end-of-sequence token."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(vocab_size - 1,))


def random_model_parts(path: str, dtype: Any, seed: int = 0) -> tuple[ModelConfig, Any, Tokenizer]:
    """(config, weights on the default device in `dtype`, tokenizer) of a `random:NAME` model."""
    import jax

    from jaxserve.model.weights import random_weights

    cfg = preset(path)
    return cfg, random_weights(cfg, jax.random.key(seed), dtype), synthetic_tokenizer(cfg.vocab_size)
