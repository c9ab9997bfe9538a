"""Pure-jnp paged attention: the numerical reference every backend is tested against.

K/V pages are laid out head-major, `[kv_heads, num_pages, page_size, head_dim]`: one page of one
KV head is a contiguous `[page_size, head_dim]` tile (what a kernel's bulk copy wants), and the
gather of a row's pages lands directly in the `[kv_heads, batch, keys, head_dim]` order the two
batched products use, so XLA moves each key once and transposes nothing large.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def paged_attention_reference(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    q_positions: jax.Array,  # [batch, q_len] int32: query i sees keys at positions <= q_positions[i]
    *,
    sm_scale: float | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """Causal grouped-query attention over paged K/V; the softmax runs in float32."""
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
