"""Pure-jnp paged attention.

`paged_attention` is the numerical reference of the decode kernels (same signature). The engine's
XLA path, `paged_attention_reference`, serves mixed prefill and decode rows by query positions.

Pages are head-major, `[kv_heads, num_pages, page_size, head_dim]`: one page of one KV head is a
contiguous `[page_size, head_dim]` tile (what a kernel's bulk copy wants). The XLA path attends one
KV head at a time: gathering a head's pages is a plain copy of whole tiles into `[batch, keys,
head_dim]`, and each head's products are batched over rows only. On XLA:CPU this is what keeps decode
cheap: one gather and product over all heads at once (batch `[kv_heads, rows]`) made the gather a
transposing loop and the products many tiny ones: a 32-row decode step of the embedded model over
10 pages took 118 ms that way against 109 ms this way (both built in one process, alternated).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import paged_flash_attention, softcapped


def paged_attention(
    q: jax.Array,  # [batch, heads, head_dim]: one query token per slot
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    lengths: jax.Array,  # [batch] int32: slot b attends to its first lengths[b] tokens
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    block_sizes: Any = None,
    interpret: bool | None = None,
) -> jax.Array:  # [batch, heads, head_dim]
    """Decode attention of each slot's query (at position lengths - 1) over its pages; slots of length 0 return
    zeros. `softcap`, `window`: see pallas_kernels.flash_attention.reference."""
    del block_sizes, interpret
    out = paged_flash_attention(q[:, None], k_pages, v_pages, page_table, lengths - 1, lengths,
                                causal=False, sm_scale=sm_scale, softcap=softcap, window=window)
    return out[:, 0]


def paged_attention_reference(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    q_positions: jax.Array,  # [batch, q_len] int32: query i sees keys at positions <= q_positions[i]
    *,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """Causal grouped-query attention over paged K/V, query i seeing keys <= q_positions[i] (and with a `window`,
    > q_positions[i] - window); the softmax runs in float32. The engine's attention on XLA (CPU, or `--attention
    reference`). `softcap`: see pallas_kernels.flash_attention.reference."""
    b, t, h, hd = q.shape
    kv, _, page_size, _ = k_pages.shape
    if h % kv:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kv}")
    if k_pages.shape[-1] != hd or v_pages.shape != k_pages.shape:
        raise ValueError(f"{k_pages.shape=} and {v_pages.shape=} do not match head_dim={hd} of {q.shape=}")
    if page_table.shape[0] != b or q_positions.shape != (b, t):
        raise ValueError(f"{page_table.shape=} and {q_positions.shape=} do not match {q.shape=}")
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    groups, keys = h // kv, page_table.shape[1] * page_size
    visible = jnp.arange(keys)[None, None, :] <= q_positions[:, :, None]  # [b, t, keys]
    if window is not None:
        visible = visible & (jnp.arange(keys)[None, None, :] > q_positions[:, :, None] - window)
    visible = jnp.repeat(visible, groups, axis=1)  # [b, t * groups, keys], query-major like each head's queries
    # Keys past the row's last query hold stale values from the page's previous owner (NaN, after a
    # request whose activations overflowed); zero them, since a zero weight times NaN is still NaN.
    written = jnp.arange(keys)[None, :, None] <= q_positions.max(axis=1)[:, None, None]  # [b, keys, 1]
    if window is not None:  # and pages wholly behind every query's window may have been handed to another request
        written = written & (jnp.arange(keys)[None, :, None] > q_positions.min(axis=1)[:, None, None] - window)
    q = q.reshape(b, t, kv, groups, hd)
    out = []
    for head in range(kv):
        k = k_pages[head][page_table].reshape(b, keys, hd).astype(q.dtype)  # float8 pages: upcast as gathered
        v = v_pages[head][page_table].reshape(b, keys, hd).astype(q.dtype)
        v = jnp.where(written, v, jnp.zeros((), v.dtype))
        qh = q[:, :, head].reshape(b, t * groups, hd)
        scores = softcapped(jnp.einsum("bqd,bsd->bqs", qh, k, preferred_element_type=jnp.float32) * scale, softcap)
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v.dtype)
        out.append(jnp.einsum("bqs,bsd->bqd", probs, v).reshape(b, t, groups, hd))
    return jnp.stack(out, axis=2).reshape(b, t, h, hd)


def reads_float8_pages(head_dim: int) -> bool:
    """Gathered pages are upcast to the queries' dtype: any head_dim."""
    return True


def combine_splits(o_part: jax.Array, lse: jax.Array, *, base2: bool = False) -> jax.Array:
    """The attention over a whole sequence from its splits' partials: o_part [b, kv, splits, group, hd] (each
    normalised over its split) and their log-sum-exps lse [b, kv, splits, group] (natural, or base 2)
    -> [b, kv, group, hd] float32. A split that saw no token has lse -inf and weight 0.

    Written out over the few splits rather than reduced along their axis: elementwise ops on slices are
    one XLA fusion, where a reduction over the splits is a kernel of its own, and so is each step after it
    (at batch 1 this is two kernels fewer per layer)."""
    exp = jnp.exp2 if base2 else jnp.exp
    lse_s = [lse[:, :, i] for i in range(lse.shape[2])]
    top = functools.reduce(jnp.maximum, lse_s)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = [exp(x - top) for x in lse_s]
    total = functools.reduce(jnp.add, w)
    o = functools.reduce(jnp.add, [wi[..., None] * o_part[:, :, i] for i, wi in enumerate(w)])
    return o / jnp.where(total == 0, 1.0, total)[..., None]
