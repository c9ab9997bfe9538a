"""Paged decode attention: one query token per slot over its K/V pages, ragged lengths, GQA.

Layout of pages: [kv_heads, num_pages, page_size, head_dim]. `backend` as in flash_attention.
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention import check_options
from pallas_kernels.paged_attention.reference import paged_attention_reference


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, lengths: jax.Array,
                    *, sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                    backend: str = "auto", block_sizes: Any = None, interpret: bool | None = None) -> jax.Array:
    """q [b, heads, hd] attends to the first lengths[b] tokens of its row's pages -> [b, heads, hd]; with a sliding
    `window`, to the last `window` of them. `softcap`: see pallas_kernels.flash_attention.reference."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got q.shape={q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"pages must be [kv_heads, num_pages, page_size, head_dim], got {k_pages.shape=} {v_pages.shape=}")
    b, h, hd = q.shape
    kv = k_pages.shape[0]
    if h % kv:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kv}")
    if k_pages.shape[3] != hd:
        raise ValueError(f"q head_dim={hd} differs from the pages' head_dim={k_pages.shape[3]}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table.shape={page_table.shape} must be [batch={b}, pages_per_row]")
    if lengths.shape != (b,):
        raise ValueError(f"lengths.shape={lengths.shape} must be ({b},)")
    check_options(softcap, window)
    module = backend_lib.implementation(__name__, backend)
    return module.paged_attention(q, k_pages, v_pages, page_table, lengths, sm_scale=sm_scale, softcap=softcap,
                                  window=window, block_sizes=block_sizes, interpret=interpret)


def reads_float8_pages(backend: str, head_dim: int) -> bool:
    """Whether `backend` (resolved for this platform, as the kernels are) reads float8_e4m3fn pages at `head_dim`."""
    return backend_lib.implementation(__name__, backend).reads_float8_pages(head_dim)


__all__ = ["paged_attention", "paged_attention_reference", "reads_float8_pages"]
