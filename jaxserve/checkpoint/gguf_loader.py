"""GGUF checkpoints through the `gguf` package: metadata, tokenizer, dequantized weights."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.checkpoint.tokenizer import Tokenizer, tokenizer_from_gguf
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.errors import CheckpointError
from jaxserve.model.weights import Layer, Weights

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def _open(path: str) -> Any:
    import gguf

    if not os.path.isfile(path):
        raise CheckpointError(f"no such model file: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad input
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


def _metadata(reader: Any) -> dict[str, Any]:
    meta = {}
    for name, fld in reader.fields.items():
        try:
            meta[name] = fld.contents()
        except Exception:  # a field the gguf package cannot decode is not one we need
            continue
    return meta


def read_gguf(path: str, dtype: Any = np.float32) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads config, weights (dequantized, cast to `dtype`, as numpy) and tokenizer from a GGUF file."""
    reader = _open(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, set(tensors), path)
    unpermute = meta.get("general.architecture") == "llama"

    def get(name: str, transform: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        return np.ascontiguousarray(transform(_dequantize(tensors[name], path))).astype(dtype)

    def optional(name: str, transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray | None:
        return get(name, transform) if name in tensors else None

    h, kv, hd, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size

    def qk(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        # [heads*hd, d] rows -> [heads, hd, d], undoing the converter's interleaved-rope row order.
        def f(w: np.ndarray) -> np.ndarray:
            w = w.reshape(heads, hd, -1)
            if unpermute:
                w = w.reshape(heads, hd // 2, 2, -1).swapaxes(1, 2).reshape(heads, hd, -1)
            return w
        return f

    def bias(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        def f(b: np.ndarray) -> np.ndarray:
            b = b.reshape(heads, hd)
            if unpermute:
                b = b.reshape(heads, hd // 2, 2).swapaxes(1, 2).reshape(heads, hd)
            return b
        return f

    def layer(i: int) -> Layer:
        p = f"blk.{i}."
        return Layer.from_projections(
            config,
            attn_norm=get(p + "attn_norm.weight"),
            wq=get(p + "attn_q.weight", qk(h)),
            wk=get(p + "attn_k.weight", qk(kv)),
            wv=get(p + "attn_v.weight", lambda w: w.reshape(kv, hd, d)),
            wo=get(p + "attn_output.weight", lambda w: w.reshape(d, h, hd)),
            bq=optional(p + "attn_q.bias", bias(h)),
            bk=optional(p + "attn_k.bias", bias(kv)),
            bv=optional(p + "attn_v.bias", lambda b: b.reshape(kv, hd)),
            mlp_norm=get(p + "ffn_norm.weight"),
            w_gate=get(p + "ffn_gate.weight"),
            w_up=get(p + "ffn_up.weight"),
            w_down=get(p + "ffn_down.weight"),
        )

    weights = Weights(
        embed=get("token_embd.weight"),
        layers=tuple(layer(i) for i in range(config.num_layers)),
        final_norm=get("output_norm.weight"),
        lm_head=None if config.tie_word_embeddings else get("output.weight"),
    )
    return config, weights, tokenizer_from_gguf(meta, path)


def _dequantize(tensor: Any, path: str) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} uses quantization type {kind}, which jaxserve does not load; "
            f"supported types: {', '.join(SUPPORTED_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        out = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(out, dtype=np.float32).reshape(shape)
    except ValueError as e:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} data is truncated or corrupt: {e}") from e


def _config(meta: dict[str, Any], tensor_names: set[str], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unknown architecture {arch!r}; jaxserve supports {', '.join(sorted(_ARCHITECTURES))}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise CheckpointError(f"{path}: metadata key {arch}.{name} is missing")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            f"{path}: per-frequency rope factors (rope_freqs, Llama 3.1 scaling) are not read from GGUF yet; "
            "load the Hugging Face directory of this model instead"
        )
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor")))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )
