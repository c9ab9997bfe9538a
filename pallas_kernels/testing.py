"""Shared test inputs for the attention kernels: random pages and page tables, a float64 truth, tolerances."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# Relative L2 error ‖out − truth‖ / ‖truth‖ allowed, per (backend, dtype). Mosaic GPU computes
# float32 inputs with bfloat16 tensor-core operands (wgmma cannot transpose 32-bit K), so its
# float32 bound is bfloat16's.
TOLERANCES: dict[tuple[str, str], float] = {
    ("reference", "float32"): 1e-5,
    ("reference", "bfloat16"): 2e-2,
    ("mosaic_tpu", "float32"): 1e-4,
    ("mosaic_tpu", "bfloat16"): 2e-2,
    ("mosaic_gpu", "float32"): 2e-2,
    ("mosaic_gpu", "bfloat16"): 2e-2,
}


def tolerance(backend: str, dtype: Any) -> float:
    return TOLERANCES[(backend, np.dtype(dtype).name)]


def relative_error(out: Any, truth: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return math.inf
    return float(np.linalg.norm(out - truth) / max(np.linalg.norm(truth), 1e-30))


def random_page_table(rng: np.random.Generator, batch: int, pages_per_row: int, num_pages: int) -> np.ndarray:
    """[batch, pages_per_row] int32 of distinct random pages (as the allocator hands them out)."""
    if batch * pages_per_row > num_pages:
        raise ValueError(f"{batch=} rows of {pages_per_row=} need more than {num_pages=}")
    return rng.permutation(num_pages)[: batch * pages_per_row].reshape(batch, pages_per_row).astype(np.int32)


def dense_from_pages(pages: np.ndarray, page_table: np.ndarray) -> np.ndarray:
    """[kv_heads, num_pages, page_size, hd] pages gathered by rows -> [batch, pages*page_size, kv_heads, hd]."""
    b, n = page_table.shape
    kv, _, ps, hd = pages.shape
    return np.asarray(pages)[:, page_table].transpose(1, 2, 3, 0, 4).reshape(b, n * ps, kv, hd)


def poison_unused(rng: np.random.Generator, pages: np.ndarray, page_table: np.ndarray,
                  lengths: np.ndarray, first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """NaN wherever no row reads, as stale pages may hold after a request whose activations overflowed.

    pages [kv_heads, num_pages, page_size, hd]: slots outside each row's read span [first, length) (first: 0, or
    each row's first position inside a sliding window), and every page no row reads, become NaN; the table entries
    of pages wholly outside a row's span point at NaN pages, as a released page may be handed on (at least one page
    must be unused). Returns float32 (pages, page_table), new arrays.
    """
    pages = np.array(pages, np.float32)
    table = np.array(page_table)
    ps = pages.shape[2]
    first = np.zeros(len(lengths), np.int64) if first is None else np.maximum(np.asarray(first), 0)
    read = np.zeros(pages.shape[1:3], bool)  # [num_pages, page_size]
    for row, (lo, n) in enumerate(zip(first, lengths)):
        pos = np.arange(lo, n)
        read[table[row, pos // ps], pos % ps] = True
    pages[:, ~read] = np.nan
    spare = np.flatnonzero(~read.any(axis=1))
    if not len(spare):
        raise ValueError(f"every one of the {pages.shape[1]} pages is read: none is left to poison the table with")
    for row, (lo, n) in enumerate(zip(first, lengths)):
        used = -(-int(n) // ps)
        table[row, used:] = rng.choice(spare, size=table.shape[1] - used)
        behind = min(int(lo) // ps, used)
        table[row, :behind] = rng.choice(spare, size=behind)
    return pages, table


def attention_truth(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_start: np.ndarray, kv_lengths: np.ndarray, *,
                    causal: bool, sm_scale: float | None = None, softcap: float | None = None,
                    window: int | None = None) -> np.ndarray:
    """float64 numpy attention: q [b, t, h, hd], k/v [b, s, kv, hd]; the semantics of every backend (a soft-cap
    squashes the scaled scores to softcap * tanh(s / softcap); a window keeps keys after q_pos - window)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, hd = q.shape
    kv = k.shape[2]
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    k = np.repeat(k, h // kv, axis=2)
    v = np.repeat(v, h // kv, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    q_pos = q_start[:, None] + np.arange(t)[None]
    k_pos = np.arange(k.shape[1])
    visible = k_pos[None, None, :] < kv_lengths[:, None, None]
    if causal:
        visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])
    if window is not None:
        visible = visible & (k_pos[None, None, :] > q_pos[:, :, None] - window)
    scores = np.where(visible[:, None], scores, -np.inf)
    m = scores.max(-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(m), m, 0.0))
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(denom == 0, 1.0, denom)
    return np.einsum("bhts,bshd->bthd", p, v)


def random_normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> Any:
    import jax.numpy as jnp

    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
