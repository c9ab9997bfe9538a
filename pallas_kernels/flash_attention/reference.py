"""Pure-jnp flash attention (dense and paged K/V): the numerical reference for every backend.

Semantics shared by all backends. Query i of batch row b sits at position `q_start[b] + i`;
keys sit at positions 0 .. kv_len[b] - 1. A query sees every key below kv_len[b] and, when
causal, only those at or before its own position; with a sliding `window`, only keys after its
position - window (the last `window` positions, its own included). Scores are q·k times sm_scale,
then with `softcap` squashed to softcap * tanh(score / softcap). Rows that see no key return zeros.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def attend(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k: jax.Array,  # [batch, kv_len, kv_heads, head_dim]
    v: jax.Array,  # [batch, kv_len, kv_heads, head_dim]
    q_start: jax.Array,  # [batch] int32
    kv_lengths: jax.Array,  # [batch] int32
    *,
    causal: bool,
    sm_scale: float | None,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """Masked grouped-query attention on contiguous K/V; softmax in float32."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    qg = q.reshape(b, t, kv, h // kv, hd)
    scores = softcapped(jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale, softcap)
    q_pos = q_start[:, None] + jnp.arange(t)[None, :]  # [b, t]
    k_pos = jnp.arange(k.shape[1])
    visible = k_pos[None, None, :] < kv_lengths[:, None, None]
    if causal:
        visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])
    if window is not None:
        visible = visible & (k_pos[None, None, :] > q_pos[:, :, None] - window)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = (p / jnp.where(denom == 0, 1.0, denom)).astype(v.dtype)
    # Keys at or past a row's length are stale page contents (NaN, maybe): a zero weight times NaN is NaN.
    written = k_pos[None, :] < kv_lengths[:, None]  # [b, s]
    if window is not None:  # pages behind every query's window may have been handed to another request
        written = written & (k_pos[None, :] > q_start[:, None] - window)
    v = jnp.where(written[:, :, None, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def window_blocks(first_pos: Any, last_pos: Any, window: int | None, bk: int, n: Any) -> tuple[Any, Any]:
    """For the kernels: (first block any query sees, first block wholly inside every query's window) of queries at
    positions first_pos .. last_pos over K/V blocks of bk keys, n of them; (0, 0) without a window. The first block
    is at most n - 1, so a program always has a block to run."""
    if window is None:
        return 0, 0
    first = jnp.minimum(jnp.maximum(first_pos - window + 1, 0) // bk, n - 1)
    return first, jnp.maximum(last_pos - window + 1 + bk - 1, 0) // bk


def softcapped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """softcap * tanh(scores / softcap), or the scores as they are without a cap."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def flash_attention(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k: jax.Array,  # [batch, kv_len, kv_heads, head_dim]
    v: jax.Array,  # [batch, kv_len, kv_heads, head_dim]
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    block_sizes: Any = None,
    interpret: bool | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """Dense attention; causal masks align the last query with the last key (q_start = kv_len - q_len)."""
    del block_sizes, interpret
    b, t = q.shape[:2]
    s = k.shape[1]
    q_start = jnp.full((b,), s - t if causal else 0, jnp.int32)
    return attend(q, k, v, q_start, jnp.full((b,), s, jnp.int32), causal=causal, sm_scale=sm_scale, softcap=softcap,
                  window=window)


def paged_flash_attention(
    q: jax.Array,  # [batch, q_len, heads, head_dim]
    k_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array,  # [batch, pages_per_row] int32
    q_start: jax.Array,  # [batch] int32: position of query 0
    kv_lengths: jax.Array,  # [batch] int32: keys at positions < kv_lengths are valid
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    block_sizes: Any = None,
    interpret: bool | None = None,
) -> jax.Array:  # [batch, q_len, heads, head_dim]
    """A prefill chunk attending to its row's K/V held in pages (this reference gathers them)."""
    del block_sizes, interpret
    b = q.shape[0]
    kv, _, ps, hd = k_pages.shape
    # float8 pages are upcast to the queries' dtype as they are gathered
    k = k_pages[:, page_table].transpose(1, 2, 3, 0, 4).reshape(b, -1, kv, hd).astype(q.dtype)
    v = v_pages[:, page_table].transpose(1, 2, 3, 0, 4).reshape(b, -1, kv, hd).astype(q.dtype)
    return attend(q, k, v, q_start, kv_lengths, causal=causal, sm_scale=sm_scale, softcap=softcap, window=window)
