"""Hugging Face model directories: config.json + *.safetensors + tokenizer.json (Llama, Mistral, Qwen2)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from jaxserve.checkpoint.tokenizer import Tokenizer, tokenizer_from_hf_dir
from jaxserve.config import ModelConfig
from jaxserve.errors import CheckpointError, JaxserveError
from jaxserve.model.weights import Layer, Weights


def read_hf_dir(directory: str, dtype: Any = np.float32) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads config, weights (numpy, cast to `dtype` tensor by tensor) and tokenizer."""
    from safetensors import safe_open

    with open(os.path.join(directory, "config.json")) as f:
        try:
            hf_config = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{directory}/config.json is not valid JSON: {e}") from e
    try:
        config = ModelConfig.from_hf(hf_config)
    except KeyError as e:
        raise CheckpointError(f"{directory}/config.json lacks the key {e}") from e
    except JaxserveError as e:
        raise CheckpointError(f"{directory}: {e}") from e
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (jaxserve never loads pickled .bin weights)")
    handles: dict[str, Any] = {}
    for path in files:
        try:
            handle = safe_open(path, framework="flax")
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
        for name in handle.keys():  # type: ignore[attr-defined]  # noqa: SIM118
            handles[name] = handle

    def get(name: str) -> np.ndarray:
        if name not in handles:
            raise CheckpointError(f"{directory}: tensor {name!r} is missing from the safetensors files")
        return np.asarray(handles[name].get_tensor(name)).astype(np.float32)

    h, kv, hd, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size

    def cast(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).astype(dtype)

    def layer(i: int) -> Layer:
        p = f"model.layers.{i}."
        bias = config.attention_bias
        return Layer.from_projections(
            config,
            attn_norm=cast(get(p + "input_layernorm.weight")),
            wq=cast(get(p + "self_attn.q_proj.weight").reshape(h, hd, d)),
            wk=cast(get(p + "self_attn.k_proj.weight").reshape(kv, hd, d)),
            wv=cast(get(p + "self_attn.v_proj.weight").reshape(kv, hd, d)),
            wo=cast(get(p + "self_attn.o_proj.weight").reshape(d, h, hd)),
            bq=cast(get(p + "self_attn.q_proj.bias").reshape(h, hd)) if bias else None,
            bk=cast(get(p + "self_attn.k_proj.bias").reshape(kv, hd)) if bias else None,
            bv=cast(get(p + "self_attn.v_proj.bias").reshape(kv, hd)) if bias else None,
            mlp_norm=cast(get(p + "post_attention_layernorm.weight")),
            w_gate=cast(get(p + "mlp.gate_proj.weight")),
            w_up=cast(get(p + "mlp.up_proj.weight")),
            w_down=cast(get(p + "mlp.down_proj.weight")),
        )

    tied = config.tie_word_embeddings or "lm_head.weight" not in handles
    if tied and not config.tie_word_embeddings:
        config = ModelConfig.from_dict({**config.to_dict(), "tie_word_embeddings": True})
    weights = Weights(
        embed=cast(get("model.embed_tokens.weight")),
        layers=tuple(layer(i) for i in range(config.num_layers)),
        final_norm=cast(get("model.norm.weight")),
        lm_head=None if tied else cast(get("lm_head.weight")),
    )
    return config, weights, tokenizer_from_hf_dir(directory)
