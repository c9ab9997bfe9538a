"""Pure-jnp paged decode attention: the numerical reference every backend is tested against."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import paged_flash_attention


def paged_attention(
    q: jax.Array,  # [batch, heads, head_dim]: one query token per slot
    k_pages: jax.Array,  # [num_pages, kv_heads, page_size, head_dim]
    v_pages: jax.Array,  # [num_pages, kv_heads, page_size, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    lengths: jax.Array,  # [batch] int32: slot b attends to its first lengths[b] tokens
    *,
    sm_scale: float | None = None,
    block_sizes: Any = None,
    interpret: bool | None = None,
) -> jax.Array:  # [batch, heads, head_dim]
    """Decode attention of each slot's query over its pages; slots of length 0 return zeros."""
    del block_sizes, interpret
    out = paged_flash_attention(q[:, None], k_pages, v_pages, page_table, lengths - 1, lengths,
                                causal=False, sm_scale=sm_scale)
    return out[:, 0]


def paged_attention_reference(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]  (the engine's current layout)
    v_pages: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    q_positions: jax.Array,  # [batch, q_len] int32: query i sees keys at positions <= q_positions[i]
    *,
    sm_scale: float | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """The engine's attention until it moves to the kernels' layout: causal GQA, float32 softmax.

    Kept for jaxserve/model/transformer.py; the kernels use [num_pages, kv_heads, page_size, head_dim].
    """
    b, t, h, hd = q.shape
    _, page_size, kv, _ = k_pages.shape
    if h % kv:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kv}")
    if page_table.shape[0] != b or q_positions.shape != (b, t):
        raise ValueError(f"{page_table.shape=} and {q_positions.shape=} do not match {q.shape=}")
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    k = k_pages[page_table].reshape(b, -1, kv, hd)
    v = v_pages[page_table].reshape(b, -1, kv, hd)
    qg = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(k.shape[1])[None, None, :] <= q_positions[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, hd)
