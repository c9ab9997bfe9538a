"""GGUF checkpoints through the `gguf` package: metadata, tokenizer, dequantized weights.

The layout is llama.cpp's (convert_hf_to_gguf.py), and so are the options its files leave out, which llama.cpp fixes
per architecture: Gemma's local layers, query scale and local RoPE base, Qwen3-MoE's renormalised routing. Mistral's
sliding window is not written by the converter, so a Mistral GGUF attends globally, as llama.cpp runs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.checkpoint.tokenizer import Tokenizer, tokenizer_from_gguf
from jaxserve.errors import CheckpointError
from jaxserve.model.config import ModelConfig, RopeScaling
from jaxserve.model.weights import Experts, Layer, Weights

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# llama.cpp's architecture names: Mistral and Mixtral convert as "llama" (Mixtral told apart by its experts)
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                  "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
# Layer field -> llama.cpp tensor of the switches' norms (qk_norm; sandwich_norm)
_SWITCH_NORMS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "attn_out_norm": "post_attention_norm",
                 "mlp_out_norm": "post_ffw_norm"}


def _open(path: str) -> Any:
    import gguf

    class Reader(gguf.GGUFReader):
        """gguf's reader over a plain array view of its memory map: the reader slices the file once for every
        element of the tokenizer's arrays, and a slice of an np.memmap runs memmap's Python hooks each time (3.1 s
        of the embedded model's load, 0.9 s without). The view keeps the map open; the bytes are the same."""

        @property  # type: ignore[override]  # (an ndarray where gguf declares its memmap)
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    if not os.path.isfile(path):
        raise CheckpointError(f"no such model file: {path}")
    try:
        return Reader(path, "r")
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
    """Loads config, weights (dequantized, cast to `dtype`, as numpy) and tokenizer from a GGUF file in llama.cpp's
    layout (convert_hf_to_gguf.py's tensor names; Gemma's norms stored as 1 + w, as jaxserve keeps them)."""
    reader = _open(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, tensors, path)
    unpermute = meta.get("general.architecture") == "llama"

    def get(name: str, transform: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        return np.ascontiguousarray(transform(_dequantize(tensors[name], path))).astype(dtype)

    def optional(name: str, transform: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> np.ndarray | None:
        return get(name, transform) if name in tensors else None

    h, kv, hd, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size

    def rows(heads: int, permuted: bool) -> Callable[[np.ndarray], np.ndarray]:
        # [heads*hd, ...] rows -> [heads, hd, ...], undoing the converter's interleaved-rope row order for q and k.
        def f(w: np.ndarray) -> np.ndarray:
            w = w.reshape(heads, hd, *w.shape[1:])
            if permuted and unpermute:
                w = w.reshape(heads, hd // 2, 2, *w.shape[2:]).swapaxes(1, 2).reshape(w.shape)
            return w
        return f

    def layer(i: int) -> Layer:
        p = f"blk.{i}."
        if p + "attn_qkv.weight" in tensors:  # fused (Phi-3): q, k, v rows
            wq, wk, wv = np.split(get(p + "attn_qkv.weight"), [h * hd, (h + kv) * hd])
            wq, wk, wv = rows(h, True)(wq), rows(kv, True)(wk), rows(kv, False)(wv)
        else:
            wq, wk, wv = get(p + "attn_q.weight", rows(h, True)), get(p + "attn_k.weight", rows(kv, True)), \
                get(p + "attn_v.weight", rows(kv, False))
        gate_up: dict[str, Any] = {}
        if config.num_experts:
            gate_up["experts"] = Experts(router=get(p + "ffn_gate_inp.weight"),
                                         gate_up=np.stack([get(p + "ffn_gate_exps.weight"), get(p + "ffn_up_exps.weight")],
                                                          axis=2),
                                         down=get(p + "ffn_down_exps.weight"))
        elif p + "ffn_gate.weight" in tensors:
            gate_up.update(w_gate=get(p + "ffn_gate.weight"), w_up=get(p + "ffn_up.weight"),
                           w_down=get(p + "ffn_down.weight"))
        else:  # fused (Phi-3): gate rows, then up rows
            w_gate, w_up = np.split(get(p + "ffn_up.weight"), 2)
            gate_up.update(w_gate=w_gate, w_up=w_up, w_down=get(p + "ffn_down.weight"))
        norms: dict[str, Any] = {name: get(p + f"{gguf_name}.weight") for name, gguf_name in _SWITCH_NORMS.items()
                 if getattr(config, "qk_norm" if name in ("q_norm", "k_norm") else "sandwich_norm")}
        return Layer.from_projections(
            config, attn_norm=get(p + "attn_norm.weight"), wq=wq, wk=wk, wv=wv,
            wo=get(p + "attn_output.weight", lambda w: w.reshape(d, h, hd)),
            bq=optional(p + "attn_q.bias", rows(h, True)), bk=optional(p + "attn_k.bias", rows(kv, True)),
            bv=optional(p + "attn_v.bias", rows(kv, False)), mlp_norm=get(p + "ffn_norm.weight"), **gate_up, **norms)

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


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
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
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(
            f"{path}: per-frequency rope factors (rope_freqs, Llama 3.1 scaling) are not read from GGUF yet; "
            "load the Hugging Face directory of this model instead"
        )
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    experts = int(key("expert_count", 0))
    family = "mixtral" if arch == "llama" and experts else _ARCHITECTURES[arch]
    gemma = family in ("gemma2", "gemma3")
    window = key("attention.sliding_window", 0) or None
    if arch == "gemma3" and window is None:
        local_layers: tuple[int, ...] | None = None
    elif gemma:  # llama.cpp's fixed patterns (every other layer; five in six) unless the file names one
        local_layers = _swa_layers(meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6),
                                   layers)
    else:
        local_layers = None
    # llama.cpp's Gemma query scale: 1 / sqrt(hidden / heads) for the 27B models (46, 62 layers), else head_dim's
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
    return ModelConfig(
        architecture=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, tensors, path),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=None if window is None else int(window),
        local_layers=local_layers,
        local_rope_theta=float(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=gemma,
        sandwich_norm="blk.0.post_attention_norm.weight" in tensors,
        query_pre_attn_scalar=(hidden / heads if big else head_dim) if gemma else None,
        attn_softcap=meta.get(f"{arch}.attn_logit_softcapping") or None,
        final_softcap=meta.get(f"{arch}.final_logit_softcapping") or None,
        num_experts=experts,
        experts_per_token=int(key("expert_used_count", 0)),
        moe_intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))) if experts else 0,
        norm_topk_prob=True,  # llama.cpp renormalises the top-k weights of both Mixtral and Qwen3-MoE
    )


def _swa_layers(pattern: Any, layers: int) -> tuple[int, ...]:
    """The local layers of llama.cpp's sliding-window pattern: a count n (layer i local unless i % n == n - 1), or
    one flag a layer."""
    if isinstance(pattern, list):
        return tuple(i for i, local in enumerate(pattern) if local)
    n = int(pattern)
    return tuple(i for i in range(layers) if n == 0 or i % n < n - 1)


def _rope_scaling(meta: dict[str, Any], arch: str, tensors: dict[str, Any], path: str) -> RopeScaling | None:
    if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3): the factors are tensors
        def factors(name: str) -> tuple[float, ...]:
            return tuple(float(f) for f in _dequantize(tensors[name], path).reshape(-1))

        original = int(meta[f"{arch}.rope.scaling.original_context_length"])
        return RopeScaling(kind="longrope", factor=int(meta[f"{arch}.context_length"]) / original,
                           original_max_position_embeddings=original, short_factor=factors("rope_factors_short.weight"),
                           long_factor=factors("rope_factors_long.weight"),
                           attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)))
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        return RopeScaling(kind="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    return None
