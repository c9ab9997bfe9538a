"""Flash attention (prefill): dense K/V, or a chunk attending to its row's K/V held in pages.

`backend`: "auto" (Mosaic GPU on GPU, Mosaic TPU on TPU, reference elsewhere), "pallas" (the
platform's Pallas kernel; on CPU the Mosaic GPU one, interpreted), "reference", "mosaic_gpu",
"mosaic_tpu" (interpreted off their platform). Layout of pages: [kv_heads, num_pages, page_size, head_dim].
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels import backend as backend_lib


def _impl(backend: str) -> Any:
    return backend_lib.implementation(__name__, backend)


def _check_q(q: jax.Array, kv_heads: int, head_dim: int) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, q_len, heads, head_dim], got q.shape={q.shape}")
    if q.shape[3] != head_dim:
        raise ValueError(f"q head_dim={q.shape[3]} differs from the K/V head_dim={head_dim}")
    if q.shape[2] % kv_heads:
        raise ValueError(f"heads={q.shape[2]} must be a multiple of kv_heads={kv_heads}")


def check_options(softcap: float | None, window: int | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be positive (or None: no cap)")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be at least 1 (or None: no sliding window)")


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, sm_scale: float | None = None,
                    softcap: float | None = None, window: int | None = None, backend: str = "auto",
                    block_sizes: Any = None, interpret: bool | None = None) -> jax.Array:
    """Attention of q [b, q_len, heads, hd] over k, v [b, kv_len, kv_heads, hd] -> [b, q_len, heads, hd].

    Causal masks align the last query with the last key (a chunk that ends the sequence). `softcap` and the
    sliding `window`: see reference.py.
    """
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [batch, kv_len, kv_heads, head_dim], got {k.shape=} {v.shape=}")
    _check_q(q, k.shape[2], k.shape[3])
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"batch of q={q.shape[0]} differs from batch of k={k.shape[0]}")
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention needs q_len={q.shape[1]} <= kv_len={k.shape[1]}")
    check_options(softcap, window)
    return _impl(backend).flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, softcap=softcap, window=window,
                                          block_sizes=block_sizes, interpret=interpret)


def paged_flash_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                          q_start: jax.Array, kv_lengths: jax.Array, *, causal: bool = True,
                          sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                          backend: str = "auto", block_sizes: Any = None, interpret: bool | None = None) -> jax.Array:
    """A prefill chunk q [b, q_len, heads, hd] at positions q_start[b] + i over its row's pages.

    Keys are the row's first kv_lengths[b] tokens, read from the pages its page_table row lists
    (the chunk's own K/V written there first). Returns [b, q_len, heads, hd].
    """
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"pages must be [kv_heads, num_pages, page_size, head_dim], got {k_pages.shape=} {v_pages.shape=}")
    _check_q(q, k_pages.shape[0], k_pages.shape[3])
    b = q.shape[0]
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table.shape={page_table.shape} must be [batch={b}, pages_per_row]")
    if q_start.shape != (b,) or kv_lengths.shape != (b,):
        raise ValueError(f"q_start.shape={q_start.shape} and kv_lengths.shape={kv_lengths.shape} must be ({b},)")
    check_options(softcap, window)
    return _impl(backend).paged_flash_attention(q, k_pages, v_pages, page_table, q_start, kv_lengths, causal=causal,
                                                sm_scale=sm_scale, softcap=softcap, window=window,
                                                block_sizes=block_sizes, interpret=interpret)


__all__ = ["check_options", "flash_attention", "paged_flash_attention"]
