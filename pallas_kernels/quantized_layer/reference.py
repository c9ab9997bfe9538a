"""What the int8 decode-layer kernel computes, in plain jnp: from a layer's attention output to the next layer's qkv.

One layer of the decoder past its attention (wo, the residual, the MLP's norm, gate_up, SiLU·up, down, the residual)
and the next layer's first product (its norm and qkv), with int8 weights of per-channel scales:

    h1  = h0 + a · woᵀ
    gu  = (h1 · g_mlp) · gate_upᵀ / rms(h1)         (gate and up of each ffn channel)
    h2  = h1 + (silu(gate) · up) · downᵀ
    qkv = (h2 · g_attn) · qkvᵀ / rms(h2)

with rms(h) = sqrt(mean(h²) + eps) over each row, the residual h rounded to h0's dtype after each add, as the model
(jaxserve.model.transformer) rounds it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LayerWeights(NamedTuple):
    """A layer's products past attention and the next layer's qkv, int8 values [n, k] and float32 scales [n]."""

    wo: jax.Array  # [d, d] int8
    wo_scales: jax.Array  # [d]
    mlp_norm: jax.Array  # [d] the MLP norm's gain
    gate_up: jax.Array  # [f, 2, d] int8: each ffn channel's gate row, then its up row
    gate_up_scales: jax.Array  # [2, f]: the gate rows' scales, then the up rows'
    down: jax.Array  # [d, f] int8
    down_scales: jax.Array  # [d]
    attn_norm: jax.Array  # [d] the next layer's attention norm's gain
    qkv: jax.Array  # [nq, d] int8
    qkv_scales: jax.Array  # [nq]


def _product(x: jax.Array, values: jax.Array, scales: jax.Array) -> jax.Array:
    return jnp.dot(x.astype(jnp.float32), values.astype(jnp.float32).T, precision="highest") * scales


def decode_layer(a: jax.Array, h0: jax.Array, w: LayerWeights, *, eps: float,
                 out_dtype: Any = None) -> tuple[jax.Array, jax.Array]:
    """(h2 [m, d] in h0's dtype, qkv [m, nq] in out_dtype, default h0's) for the attention output a [m, d] and the
    residual h0 [m, d]."""
    def rms_inverse(h):
        h32 = h.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)

    h1 = (h0.astype(jnp.float32) + _product(a, w.wo, w.wo_scales)).astype(h0.dtype)
    x = h1.astype(jnp.float32) * w.mlp_norm.astype(jnp.float32)
    gate = _product(x, w.gate_up[:, 0], w.gate_up_scales[0]) * rms_inverse(h1)
    up = _product(x, w.gate_up[:, 1], w.gate_up_scales[1]) * rms_inverse(h1)
    h2 = (h1.astype(jnp.float32) + _product(jax.nn.silu(gate) * up, w.down, w.down_scales)).astype(h0.dtype)
    x = h2.astype(jnp.float32) * w.attn_norm.astype(jnp.float32)
    qkv = _product(x, w.qkv, w.qkv_scales) * rms_inverse(h2)
    return h2, qkv.astype(out_dtype or h0.dtype)
