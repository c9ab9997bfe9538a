"""A Hugging Face `config.json` as a ModelConfig: each family's options as the model's switches.

| model_type              | switches                                                                         |
|-------------------------|----------------------------------------------------------------------------------|
| llama                   | none                                                                             |
| mistral, mixtral        | sliding_window on every layer (when set); mixtral: experts, norm_topk_prob       |
| qwen2, qwen3, qwen3_moe | attention_bias (qwen2); qk_norm (qwen3*); the window where use_sliding_window    |
| phi3                    | sliding_window; longrope rope_scaling (fused qkv / gate_up are split at load)    |
| gemma2, gemma3(_text)   | embed_scale, sandwich_norm, gelu_tanh, query_pre_attn_scalar, soft-caps, local    |
|                         | layers; gemma3: qk_norm and local_rope_theta                                      |
"""

from __future__ import annotations

import math
from typing import Any

from jaxserve.errors import JaxserveError
from jaxserve.model.config import ARCHITECTURES, ModelConfig, RopeScaling

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (raises JaxserveError naming what it cannot take)."""
    model_type = hf.get("model_type", "")
    if model_type == "gemma3" and "text_config" in hf:  # the multimodal wrapper: its language model
        hf = {**hf["text_config"], "model_type": "gemma3"}
    family = "gemma3" if model_type == "gemma3_text" else model_type
    if family not in ARCHITECTURES:
        raise JaxserveError(f"unknown architecture model_type={model_type!r} in config.json; "
                            f"jaxserve supports {', '.join(ARCHITECTURES)}")
    num_heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    gemma = family in ("gemma2", "gemma3")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise JaxserveError(f"config.json: activation {act!r} is not supported; jaxserve takes {sorted(_ACTIVATIONS)}")
    window, local_layers = _window(hf, family, num_layers)
    theta, local_theta, scaling = _rope(hf, family)
    experts = _experts(hf, family)
    return ModelConfig(
        architecture=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        sliding_window=window,
        local_layers=local_layers,
        local_rope_theta=local_theta,
        activation=_ACTIVATIONS[act],
        embed_scale=gemma,
        sandwich_norm=gemma,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)) if gemma else None,
        attn_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_softcap=hf.get("final_logit_softcapping") if gemma else None,
        **experts,
    )


def _window(hf: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, local_layers) as transformers applies them for the family."""
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, None
    types = hf.get("layer_types")
    if types is None and family == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if types is None and family == "gemma3":
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None and family in ("qwen2", "qwen3"):
        start = hf.get("max_window_layers", num_layers)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if types is None or family in ("mistral", "mixtral", "phi3", "qwen3_moe"):  # every layer, as their models do
        return int(window), None
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not local:
        return None, None
    return int(window), (None if len(local) == num_layers else local)


def _rope(hf: dict[str, Any], family: str) -> tuple[float, float | None, RopeScaling | None]:
    """(rope_theta, local_rope_theta, rope_scaling) from rope_theta/rope_scaling (older configs) or rope_parameters."""
    params = hf.get("rope_parameters") or {}
    local_theta = None
    if family == "gemma3":
        if "full_attention" in params:
            local_theta = float(params.get("sliding_attention", {}).get("rope_theta", 10000.0))
            params = params["full_attention"]
        else:
            local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    return theta, local_theta, _rope_scaling(hf, scaling)


def _rope_scaling(hf: dict[str, Any], rs: dict[str, Any]) -> RopeScaling | None:
    kind = rs.get("rope_type") or rs.get("type")
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise JaxserveError(f"config.json: partial_rotary_factor={rs['partial_rotary_factor']} (rotary embeddings on "
                            "part of each head) is not supported")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=float(rs["factor"]), low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
    if kind in ("longrope", "su"):
        original = int(rs.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
        factor = float(rs.get("factor") or hf.get("max_position_embeddings", original) / original)
        attention = rs.get("attention_factor")
        if attention is None:  # the LongRoPE paper's, as transformers computes it
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return RopeScaling(kind="longrope", factor=factor, original_max_position_embeddings=original,
                           short_factor=tuple(rs["short_factor"]), long_factor=tuple(rs["long_factor"]),
                           attention_factor=float(attention))
    raise JaxserveError(f"unsupported rope scaling type {kind!r} in config.json; expected linear, llama3 or longrope")


def _experts(hf: dict[str, Any], family: str) -> dict[str, Any]:
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise JaxserveError(f"config.json: dense layers among the experts' (mlp_only_layers={hf.get('mlp_only_layers')}"
                            f", decoder_sparse_step={hf.get('decoder_sparse_step')}) are not supported")
    return {"num_experts": hf.get("num_local_experts") or hf["num_experts"],
            "experts_per_token": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
            "norm_topk_prob": family == "mixtral" or bool(hf.get("norm_topk_prob", False))}
