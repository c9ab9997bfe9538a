"""The decoder as pure functions over the `Weights` pytree: one model for every family.

Llama's block (RMSNorm, attention with RoPE, a gated MLP), with the switches of ModelConfig read where they apply:
q/k biases and norms, sliding-window (local) layers with their own RoPE base, the attention scale and soft-cap
(AttentionSpec), GeGLU, sandwich norms, scaled embeddings, a soft-capped head, and a mixture of experts in place of
the MLP (jaxserve.model.moe). Llama (1/2/3), Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3, Mixtral and Qwen3-MoE are
this one model (jaxserve.checkpoint.hf_config maps each family's options). Layers are
unrolled in Python rather than run under `lax.scan`: XLA then schedules each layer's weight
reads independently, which is what makes small-batch decode bandwidth-bound instead of
latency-bound (see ../shared/ANCHORS.md: scan 34 %, unrolled 82 % of the floor).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.attention import AttentionFn, AttentionSpec, update_and_attend
from jaxserve.model.config import ModelConfig, RopeScaling
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.moe import glu, moe_mlp
from jaxserve.model.quant import embed_lookup, linear, row_multiple
from jaxserve.model.weights import Layer, Weights, split_qkv
from pallas_kernels import decode_megakernel


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [batch, seq, vocab] float32
    cache: KVCache
    hidden_states: tuple[jax.Array, ...]  # inputs of each layer, when asked for; else ()
    final: jax.Array | None = None  # [batch, seq, embed]: the last layer's output at every position, before the
    # final norm (what prompt log-probabilities are computed from, jaxserve.step)


def normed_linear(x: jax.Array, gain: jax.Array, w: Any, eps: float, *, preferred_element_type: Any = None) -> jax.Array:
    """RMSNorm(x) · gain, times the weight w [*out, embed] (see `linear`).

    The norm's 1/rms is one number per row, so it is applied to the product's output instead of its
    input: the product reads x · gain, which needs no reduction first. XLA then fuses x · gain with
    whatever made x (the residual add), and the reduction runs beside the product instead of
    between two elementwise kernels; 1/rms fuses into the output's consumer. The same sum, reordered.
    """
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., 1] float32
    y = linear(gain * x, w, preferred_element_type=preferred_element_type)
    inv_rms = inv_rms.reshape(inv_rms.shape + (1,) * (y.ndim - x.ndim))
    return (y * inv_rms).astype(y.dtype)


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, in float32, times the gain, in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype) * gain


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2], with linear or Llama-3 scaling applied; for LongRoPE [2, head_dim
    // 2]: the short factors' row, then the long factors' (apply_rope picks one by position)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.kind == "longrope":
        return np.stack([inv_freq / np.asarray(scaling.short_factor), inv_freq / np.asarray(scaling.long_factor)]
                        ).astype(np.float32)
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array,
               scaling: RopeScaling | None = None) -> jax.Array:
    """Rotates x [batch, seq, heads, head_dim] by its positions [batch, seq] (half-split layout). LongRoPE (`scaling`
    of that kind, inv_freq [2, head_dim // 2]) takes the long factors at positions from original_max_position_embeddings
    on and scales cos and sin by attention_factor. Each position's rotation is its own, whatever the sequence's
    length or chunking: transformers instead re-rotates every position of a sequence grown past that length (it
    recomputes the cache), so there such a sequence attends a little differently to its earlier positions."""
    if scaling is not None and scaling.kind == "longrope":
        long = positions[..., None] >= scaling.original_max_position_embeddings
        inv_freq = jnp.where(long, inv_freq[1], inv_freq[0])  # [b, s, hd/2]
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [b, s, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    mscale = scaling.attention_factor if scaling is not None and scaling.kind == "longrope" else 1.0
    cos, sin = (jnp.cos(angles) * mscale).astype(x.dtype), (jnp.sin(angles) * mscale).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def layer_rope(cfg: ModelConfig, local: bool) -> tuple[float, RopeScaling | None]:
    """(RoPE base, scaling) of a local or a global layer: local layers of a model with local_rope_theta take that
    base and no scaling (Gemma 3); otherwise every layer takes rope_theta and rope_scaling."""
    if local and cfg.local_rope_theta is not None:
        return cfg.local_rope_theta, None
    return cfg.rope_theta, cfg.rope_scaling


def attention_spec(cfg: ModelConfig, local: bool) -> AttentionSpec:
    """The scores of a local or a global layer (the switches query_pre_attn_scalar, attn_softcap, sliding_window)."""
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    return AttentionSpec(sm_scale=scale, softcap=cfg.attn_softcap, window=cfg.sliding_window if local else None)


@partial(jax.jit, static_argnames=("cfg", "attention", "local"))
def _layer(
    w: Layer, x: jax.Array, positions: jax.Array, valid: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
    write_at: tuple[jax.Array, jax.Array], page_table: jax.Array, inv_freq: jax.Array, *, cfg: ModelConfig,
    attention: AttentionFn, local: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer (`local`: one of the sliding-window layers). Under its own jit so that a step traces and
    lowers it once for all its layers of a kind (an 8B step's 32 copies of the attention kernel took 12 s to
    lower); XLA inlines the calls before it fuses, so the compiled step is the same as with the layers written out."""
    rows = positions.shape[0]  # x may carry padding rows past these, for the quantized products (see forward)
    eps = cfg.rms_norm_eps
    with jax.named_scope("attention"):
        qkv = normed_linear(x, w.attn_norm, w.wqkv, eps)  # [b, t, kv_heads, q_per_kv + 2, head_dim]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv
        q, k, v = split_qkv(cfg, qkv[:rows])
        if cfg.qk_norm:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        scaling = layer_rope(cfg, local)[1]
        q, k = apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling)
        attn, k_pages, v_pages = attention(q, k, v, k_pages, v_pages, write_at, page_table, positions, valid,
                                           spec=attention_spec(cfg, local))
        out = linear(_pad_rows(attn, x.shape[0] - rows), w.wo, in_ndim=2)
        x = x + (rms_norm(out, w.attn_out_norm, eps) if cfg.sandwich_norm else out)
    with jax.named_scope("mlp"):
        if cfg.num_experts:
            out = moe_mlp(rms_norm(x, w.mlp_norm, eps), w.experts, cfg)
        else:
            gate_up = normed_linear(x, w.mlp_norm, w.w_gate_up, eps)  # [b, t, ffn, 2]
            out = linear(glu(gate_up, cfg.activation), w.w_down)
        x = x + (rms_norm(out, w.mlp_out_norm, eps) if cfg.sandwich_norm else out)
    return x, k_pages, v_pages


def forward(
    weights: Weights,
    cfg: ModelConfig,
    tokens: jax.Array,  # [b, t] int32
    positions: jax.Array,  # [b, t] int32
    valid: jax.Array,  # [b, t] bool: padding tokens write nothing
    page_table: jax.Array,  # [b, pages_per_row] int32
    cache: KVCache,
    *,
    logit_indices: jax.Array | None = None,  # [b]: compute logits only at this index of each row
    return_hidden: bool = False,
    attention: str | AttentionFn = "auto",  # "auto", "reference", "pallas" (jaxserve.model.attention) or a function
) -> ForwardOutput:
    """Runs the decoder over `tokens`, writing their K/V into the pages of `cache` at `positions`.

    With `logit_indices`, logits are [b, 1, vocab] for the given index of each row (a prefill
    needs only its last token's), which skips the output head for every other position.
    `attention` names the backend of `update_and_attend`, or is a function with its signature (a
    sharded model's, from jaxserve.parallel).
    """
    attention_fn = (partial(update_and_attend, backend=attention, in_bounds=cache.padding_page)
                    if isinstance(attention, str) else attention)
    inv_freq = {local: rope_inv_freq(cfg.head_dim, *layer_rope(cfg, local)) for local in (False, True)}
    size = cache.page_size
    page_of = jnp.take_along_axis(page_table, positions // size, axis=1)
    padding = cache.num_pages - 1 if cache.padding_page else cache.num_pages  # its page, or out of bounds: dropped
    write_at = (jnp.where(valid, page_of, padding), positions % size)
    x = embed_lookup(weights.embed, tokens, weights.final_norm.dtype)
    if cfg.embed_scale:  # the factor rounded to the activations' dtype first, as Gemma's checkpoints were trained
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
    rows = x.shape[0]
    if tokens.shape[1] == 1:  # decode: the rows are padded once for the quantized products (each pads otherwise)
        x = _pad_rows(x, -rows % row_multiple(weights))  # the padding rows skip attention: they write no K/V
    hidden = []
    ks, vs = [], []
    for i, layer in enumerate(weights.layers):
        if return_hidden:
            hidden.append(x[:rows])
        local = cfg.is_local(i)
        x, k_i, v_i = _layer(layer, x, positions, valid, cache.k[i], cache.v[i], write_at, page_table,
                             inv_freq[local], cfg=cfg, attention=attention_fn, local=local)
        ks.append(k_i)
        vs.append(v_i)
    final = x[:rows]
    if logit_indices is not None:
        x = jnp.take_along_axis(x, _pad_rows(logit_indices, x.shape[0] - rows)[:, None, None], axis=1)
    logits = head_logits(weights, cfg, x)
    return ForwardOutput(logits[:rows], KVCache(k=tuple(ks), v=tuple(vs), padding_page=cache.padding_page),
                         tuple(hidden), final)


def head_logits(weights: Weights, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Logits (float32) of the last layer's output x [..., embed]: the final norm, then the output head."""
    head = weights.embed if weights.lm_head is None else weights.lm_head
    logits = normed_linear(x, weights.final_norm, head, cfg.rms_norm_eps, preferred_element_type=jnp.float32)
    return logits if cfg.final_softcap is None else cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)


def decode_stacked(weights: Weights, layers: decode_megakernel.StackedLayers, cfg: ModelConfig, tokens: jax.Array,
                   lengths: jax.Array, page_table: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_size: int,
                   *, backend: str = "auto", **options: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step of one row through the decode megakernel: tokens [1, 1] at position lengths [1] (the
    positions cached), its pages page_table [1, pages], the int8 layers stacked (decode_megakernel.stack_layers) and
    the K/V pages stacked across the layers (stack_pages) -> (logits [1, vocab] float32, k_pages, v_pages with the
    token's K/V written). `weights` gives the embedding, the final norm and the head (its layers are not read).
    The same step as `forward`'s at batch 1, with every layer in one kernel on a GPU (`backend`; `options` go to
    decode_megakernel.decode_layers)."""
    other = {k: v for k, v in cfg.switches.items() if (k, v) not in (("rope_scaling", "linear"), ("rope_scaling", "llama3"))}
    if other:  # (a qkv bias is refused by decode_megakernel.stack_layers)
        raise ValueError(f"the decode megakernel runs Llama's block; this {cfg.architecture} model turns on {other}: "
                         "serve it with decode_megakernel off")
    x = embed_lookup(weights.embed, tokens, jnp.float32)[:, 0]
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    h, k_pages, v_pages = decode_megakernel.decode_layers(cfg, layers, x, k_pages, v_pages, page_table, lengths,
                                                          inv_freq, page_size, backend=backend, **options)
    return head_logits(weights, cfg, h.astype(weights.final_norm.dtype)), k_pages, v_pages


def _pad_rows(x: jax.Array, pad: int) -> jax.Array:
    """x with `pad` zero rows appended (x itself when pad is 0)."""
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) if pad else x
