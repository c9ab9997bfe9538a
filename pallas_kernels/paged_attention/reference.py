"""Pure-jnp paged attention.

`paged_attention` is the numerical reference of the decode kernels (same signature). The engine's
XLA path, `paged_attention_reference`, serves mixed prefill and decode rows by query positions.

Pages are head-major, `[kv_heads, num_pages, page_size, head_dim]`: one page of one KV head is a
contiguous `[page_size, head_dim]` tile (what a kernel's bulk copy wants), and gathering a row's
pages lands directly in the `[kv_heads, batch, keys, head_dim]` order that XLA's batched products
use, so the XLA path moves each key once and transposes nothing large.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import paged_flash_attention


def paged_attention(
    q: jax.Array,  # [batch, heads, head_dim]: one query token per slot
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
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
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    q_positions: jax.Array,  # [batch, q_len] int32: query i sees keys at positions <= q_positions[i]
    *,
    sm_scale: float | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """Causal grouped-query attention over paged K/V, query i seeing keys <= q_positions[i]; the
    softmax runs in float32. The engine's attention on XLA (CPU, or `--attention reference`)."""
    b, t, h, hd = q.shape
    kv, _, page_size, _ = k_pages.shape
    if h % kv:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kv}")
    if k_pages.shape[-1] != hd or v_pages.shape != k_pages.shape:
        raise ValueError(f"{k_pages.shape=} and {v_pages.shape=} do not match head_dim={hd} of {q.shape=}")
    if page_table.shape[0] != b or q_positions.shape != (b, t):
        raise ValueError(f"{page_table.shape=} and {q_positions.shape=} do not match {q.shape=}")
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    keys = page_table.shape[1] * page_size
    k = k_pages[:, page_table].reshape(kv, b, keys, hd)
    v = v_pages[:, page_table].reshape(kv, b, keys, hd)
    qg = jnp.einsum("btkgd->kbtgd", q.reshape(b, t, kv, h // kv, hd)).reshape(kv, b, t * (h // kv), hd)
    scores = jnp.einsum("kbqd,kbsd->kbqs", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(keys)[None, None, :] <= q_positions[:, :, None]  # [b, t, keys]
    visible = jnp.repeat(visible, h // kv, axis=1)  # [b, t * groups, keys], query-major like qg
    scores = jnp.where(visible[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Keys past the row's last query hold stale values from the page's previous owner (NaN, after a
    # request whose activations overflowed); zero them, since a zero weight times NaN is still NaN.
    written = jnp.arange(keys)[None, :] <= q_positions.max(axis=1)[:, None]  # [b, keys]
    v = jnp.where(written[None, :, :, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("kbqs,kbsd->kbqd", probs, v).reshape(kv, b, t, h // kv, hd)
    return jnp.einsum("kbtgd->btkgd", out).reshape(b, t, h, hd)
