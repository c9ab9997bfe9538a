"""Small random models written to disk the way real converters write them."""

from __future__ import annotations

import os

import numpy as np
import torch
from tokenizers import pre_tokenizers

TINY = {"vocab_size": 260, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def hf_tiny(model_type: str, *, router_scale: float = 0.5, **overrides):
    """A random transformers model of `model_type` (any causal LM transformers knows) in float32."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # random norms and biases, so a loader that drops them fails
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # routing far from ties
                p.copy_(torch.randn_like(p) * router_scale)
    return model


def byte_vocab() -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return alphabet + ["<s>", "</s>", "<unk>", "<pad>"]


def _permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Q and K (interleaved rotary pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, model=None, *, arch: str = "llama", qtype: str = "F32",
               tensor_types: dict[str, str] | None = None) -> None:
    """Writes `model` (a transformers Llama/Qwen2) as GGUF, quantizing 2-D weights to `qtype`."""
    import gguf

    model = model if model is not None else hf_tiny("llama")
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    vocab = byte_vocab()
    writer.add_token_list(vocab)
    writer.add_token_types([1] * 256 + [3] * 4)
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in sd.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{layer_names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                value = _permute_for_gguf(value, cfg.num_attention_heads)
            if arch == "llama" and module == "self_attn.k_proj":
                value = _permute_for_gguf(value, cfg.num_key_value_heads)
        else:
            name = names[key]
        kind_name = (tensor_types or {}).get(name, qtype if value.ndim == 2 else "F32")
        qt = gguf.GGMLQuantizationType[kind_name]
        if kind_name == "F32":
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert os.path.getsize(path) > 0


def save_tiny(model, directory) -> None:
    """`model` (hf_tiny's) saved as transformers saves it, beside a word-level tokenizer over its vocabulary."""
    from jaxserve.checkpoint.random_model import synthetic_tokenizer

    model.save_pretrained(directory, safe_serialization=True)
    synthetic_tokenizer(model.config.vocab_size).backend.save(os.path.join(directory, "tokenizer.json"))
