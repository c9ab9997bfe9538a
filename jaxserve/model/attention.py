"""The model's one attention call: paged K/V, any mix of prefill chunks and decode rows.

`backend` picks the implementation (`pallas_kernels.backend`): "reference" is the pure-XLA path,
"pallas" the platform's Pallas kernels (on CPU the Mosaic GPU kernels in interpret mode),
"mosaic_gpu" / "mosaic_tpu" one kernel family (interpreted off its platform), and "auto" the
kernels where they exist for the platform (GPU, TPU) and XLA elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention import paged_flash_attention
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

FLASH_BLOCK_Q = 128  # the flash kernels tile queries by 128 positions; shorter chunks are padded
DECODE_KERNEL_QUERIES = 8  # chunks this short attend through the decode kernel, a row per query (see attend)

# (q, k, v, k_pages, v_pages, write_at, page_table, positions, valid, *, spec) -> (out, k_pages, v_pages); see
# `update_and_attend`.
AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's scores become attention weights, beyond causal softmax(q·k / sqrt(head_dim)) (the model's
    switches, ModelConfig): the scale, a soft-cap (softcap * tanh(score / softcap)) and a sliding window (a query
    sees the last `window` positions, its own included). Every backend takes them (pallas_kernels)."""

    sm_scale: float | None = None  # None: head_dim ** -0.5
    softcap: float | None = None
    window: int | None = None

    def options(self) -> dict[str, Any]:
        """The kernels' keyword arguments."""
        return {"sm_scale": self.sm_scale, "softcap": self.softcap, "window": self.window}


PLAIN = AttentionSpec()  # Llama's scores


def to_pages(x: jax.Array, dtype) -> jax.Array:
    """x in the pages' dtype; for 8-bit floats clipped to their range first (float8_e4m3fn has no inf: an
    out-of-range value would become NaN)."""
    if jnp.dtype(dtype).itemsize == 1:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)
    return x.astype(dtype)


def write_pages(k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array, pages: jax.Array,
                offsets: jax.Array, *, in_bounds: bool = False) -> tuple[jax.Array, jax.Array]:
    """Writes k, v [b, t, kv_heads, hd] at (pages, offsets) [b, t]; a page id past the pool drops the token,
    unless `in_bounds` promises there is none (padding tokens then write to the cache's padding page)."""
    pages, offsets = pages.reshape(-1), offsets.reshape(-1)
    flat = (k.shape[0] * k.shape[1], *k.shape[2:])  # [tokens, kv_heads, head_dim]
    k, v = jnp.swapaxes(k.reshape(flat), 0, 1), jnp.swapaxes(v.reshape(flat), 0, 1)  # [kv_heads, tokens, head_dim]
    if in_bounds and pages.shape[0] == 1:
        # One token (decode at batch 1): an update in place. XLA makes a one-index scatter that, with a
        # bounds check and a select that reads the old value, which keeps it from fusing with its producer.
        at = (0, pages[0], offsets[0], 0)
        return (jax.lax.dynamic_update_slice(k_pages, to_pages(k[:, :, None], k_pages.dtype), at),
                jax.lax.dynamic_update_slice(v_pages, to_pages(v[:, :, None], v_pages.dtype), at))
    mode = "promise_in_bounds" if in_bounds else "drop"
    return (k_pages.at[:, pages, offsets].set(to_pages(k, k_pages.dtype), mode=mode),
            v_pages.at[:, pages, offsets].set(to_pages(v, v_pages.dtype), mode=mode))


def update_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      write_at: tuple[jax.Array, jax.Array], page_table: jax.Array, positions: jax.Array,
                      valid: jax.Array, *, backend: str = "auto", in_bounds: bool = False,
                      spec: AttentionSpec = PLAIN) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes k, v at write_at = (pages, offsets) [b, t], then attends q [b, t, heads, hd] over the pages
    -> (out [b, t, heads, hd], k_pages, v_pages).

    One layer's whole use of its cache; a sharded model swaps in another function of the same
    signature (jaxserve.parallel.attention). `in_bounds`: see write_pages; `spec`: the layer's scores."""
    k_pages, v_pages = write_pages(k, v, k_pages, v_pages, *write_at, in_bounds=in_bounds)
    return attend(q, k_pages, v_pages, page_table, positions, valid, backend=backend, spec=spec), k_pages, v_pages


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, positions: jax.Array,
           valid: jax.Array, *, backend: str = "auto", spec: AttentionSpec = PLAIN) -> jax.Array:
    """q [b, t, heads, hd] at `positions` [b, t] (the valid tokens of a row are consecutive from its first
    position, and their K/V is already in the pages) -> [b, t, heads, hd]."""
    if backend_lib.resolve(backend) == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_table, positions, **spec.options())
    b, t = positions.shape
    start = positions[:, 0]
    if t <= DECODE_KERNEL_QUERIES:
        # decode (one query per slot), or a speculative verify row's few: each query a row of the decode kernel,
        # attending up to its own position. The flash kernel would pad them to FLASH_BLOCK_Q queries: 32 layers of
        # that cost a batch-1 8B step as much as 4 more tokens' K/V reads do here.
        lengths = jnp.where(valid, positions + 1, 0).reshape(b * t)
        out = paged_attention(q.reshape(b * t, *q.shape[2:]), k_pages, v_pages, jnp.repeat(page_table, t, axis=0),
                              lengths, backend=backend, **spec.options())
        return out.reshape(q.shape)
    padded = -(-t // FLASH_BLOCK_Q) * FLASH_BLOCK_Q
    qp = jnp.pad(q, ((0, 0), (0, padded - t), (0, 0), (0, 0)))
    kv_lengths = start + jnp.sum(valid, axis=1, dtype=jnp.int32)
    out = paged_flash_attention(qp, k_pages, v_pages, page_table, start, kv_lengths, causal=True, backend=backend,
                                **spec.options())
    return out[:, :t]
