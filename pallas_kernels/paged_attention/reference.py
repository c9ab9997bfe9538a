"""Pure-jnp paged attention: the numerical reference every backend is tested against."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def paged_attention_reference(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    q_positions: jax.Array,  # [batch, q_len] int32: query i sees keys at positions <= q_positions[i]
    *,
    sm_scale: float | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """Causal grouped-query attention over paged K/V; the softmax runs in float32."""
    b, t, h, hd = q.shape
    _, page_size, kv, _ = k_pages.shape
    if h % kv:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kv}")
    if page_table.shape[0] != b or q_positions.shape != (b, t):
        raise ValueError(f"{page_table.shape=} and {q_positions.shape=} do not match {q.shape=}")
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    k = k_pages[page_table].reshape(b, -1, kv, hd)  # [b, pages * page_size, kv, hd]
    v = v_pages[page_table].reshape(b, -1, kv, hd)
    qg = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(k.shape[1])[None, None, :] <= q_positions[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Keys past the row's last query hold stale values from the page's previous owner (NaN, after a
    # request whose activations overflowed); zero them, since a zero weight times NaN is still NaN.
    written = jnp.arange(v.shape[1])[None, :] <= q_positions.max(axis=1)[:, None]  # [b, s]
    v = jnp.where(written[:, :, None, None], v, jnp.zeros((), v.dtype))
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, hd)
