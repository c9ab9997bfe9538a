"""Hugging Face model directories: config.json + *.safetensors + tokenizer.json, for every family of
jaxserve.checkpoint.hf_config, in the tensor names their checkpoints use."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.checkpoint.hf_config import config_from_hf
from jaxserve.checkpoint.tokenizer import Tokenizer, tokenizer_from_hf_dir
from jaxserve.errors import CheckpointError, JaxserveError
from jaxserve.model.config import ModelConfig
from jaxserve.model.weights import Experts, Layer, Weights

# A multimodal Gemma 3 keeps its language model under a prefix (transformers 4 wrote the first, 5 the second).
_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
# The experts' tensors under a layer: (module, gate, up, down)
_EXPERTS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def read_hf_dir(directory: str, dtype: Any = np.float32) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads config, weights (numpy, cast to `dtype` tensor by tensor) and tokenizer."""
    from safetensors import safe_open

    with open(os.path.join(directory, "config.json")) as f:
        try:
            hf_config = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{directory}/config.json is not valid JSON: {e}") from e
    try:
        config = config_from_hf(hf_config)
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
    prefix = next((p for p in _PREFIXES if p + "embed_tokens.weight" in handles), "model.")

    def get(name: str) -> np.ndarray:
        if name not in handles:
            raise CheckpointError(f"{directory}: tensor {name!r} is missing from the safetensors files")
        return np.asarray(handles[name].get_tensor(name)).astype(np.float32)

    def cast(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).astype(dtype)

    gemma = config.architecture in ("gemma2", "gemma3")

    def norm(name: str) -> np.ndarray:  # Gemma's norms multiply by (1 + w): loaded as the gain they are
        return cast(get(name) + 1.0 if gemma else get(name))

    tied = config.tie_word_embeddings or "lm_head.weight" not in handles
    if tied and not config.tie_word_embeddings:
        config = ModelConfig.from_dict({**config.to_dict(), "tie_word_embeddings": True})
    weights = Weights(
        embed=cast(get(prefix + "embed_tokens.weight")),
        layers=tuple(_layer(config, f"{prefix}layers.{i}.", get, cast, norm) for i in range(config.num_layers)),
        final_norm=norm(prefix + "norm.weight"),
        lm_head=None if tied else cast(get("lm_head.weight")),
    )
    return config, weights, tokenizer_from_hf_dir(directory)


def _layer(config: ModelConfig, p: str, get: Callable[[str], np.ndarray], cast: Callable[[np.ndarray], np.ndarray],
           norm: Callable[[str], np.ndarray]) -> Layer:
    h, kv, hd, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    w_gate: np.ndarray | None = None
    w_up: np.ndarray | None = None
    if config.architecture == "phi3":  # fused: q, k, v rows in one weight; gate, then up rows in another
        wq, wk, wv = np.split(get(p + "self_attn.qkv_proj.weight"), [h * hd, (h + kv) * hd])
        w_gate, w_up = np.split(get(p + "mlp.gate_up_proj.weight"), 2)
    else:
        wq, wk, wv = (get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        if not config.num_experts:
            w_gate, w_up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
    bias = config.attention_bias
    norms: dict[str, np.ndarray] = {}
    if config.qk_norm:
        norms.update(q_norm=norm(p + "self_attn.q_norm.weight"), k_norm=norm(p + "self_attn.k_norm.weight"))
    if config.sandwich_norm:  # Gemma's post_attention_layernorm norms the attention's output; the MLP's is "pre"
        norms.update(attn_out_norm=norm(p + "post_attention_layernorm.weight"),
                     mlp_out_norm=norm(p + "post_feedforward_layernorm.weight"))
    mlp_norm = p + ("pre_feedforward_layernorm.weight" if config.sandwich_norm else "post_attention_layernorm.weight")
    return Layer.from_projections(
        config,
        attn_norm=norm(p + "input_layernorm.weight"),
        wq=cast(wq.reshape(h, hd, d)),
        wk=cast(wk.reshape(kv, hd, d)),
        wv=cast(wv.reshape(kv, hd, d)),
        wo=cast(get(p + "self_attn.o_proj.weight").reshape(d, h, hd)),
        bq=cast(get(p + "self_attn.q_proj.bias").reshape(h, hd)) if bias else None,
        bk=cast(get(p + "self_attn.k_proj.bias").reshape(kv, hd)) if bias else None,
        bv=cast(get(p + "self_attn.v_proj.bias").reshape(kv, hd)) if bias else None,
        mlp_norm=norm(mlp_norm),
        w_gate=None if w_gate is None else cast(w_gate),
        w_up=None if w_up is None else cast(w_up),
        w_down=None if config.num_experts else cast(get(p + "mlp.down_proj.weight")),
        experts=_experts(config, p, get, cast) if config.num_experts else None,
        **norms,
    )


def _experts(config: ModelConfig, p: str, get: Callable[[str], np.ndarray],
             cast: Callable[[np.ndarray], np.ndarray]) -> Experts:
    module, gate, up, down = _EXPERTS[config.architecture]
    e = f"{p}{module}.experts."
    return Experts(
        router=cast(get(f"{p}{module}.gate.weight")),
        gate_up=cast(np.stack([np.stack([get(f"{e}{i}.{gate}.weight"), get(f"{e}{i}.{up}.weight")], axis=1)
                               for i in range(config.num_experts)])),
        down=cast(np.stack([get(f"{e}{i}.{down}.weight") for i in range(config.num_experts)])),
    )
