"""Flash attention for TPUs in Pallas Mosaic TPU: K/V copied page by page by DMA, double-buffered.

One program owns `block_q` query positions of every query head of one KV head (the whole GQA
group), so each K/V block it copies serves the group: its query tile is `[group * block_q, head_dim]`,
head-major. K and V stay in HBM; blocks of `block_k` keys are copied from the pages the row's
page-table entries name (the table is prefetched into SMEM) into two VMEM buffers, the next block's
copies in flight while this one is computed. Dense K/V are viewed as pages of `block_k` keys. The
softmax is online, in float32. Keys at or past a row's length are masked in the scores and zeroed
in V, so whatever stale pages hold (NaN included) never reaches the output. With a sliding window a
program starts at the first block its queries see (blocks wholly behind the window are not copied)
and masks the blocks the window's edge crosses; a soft-cap squashes the scores before any mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.reference import softcapped, window_blocks

_NEG = -1e30  # a finite -inf, so rows that see no key never compute inf - inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic TPU flash kernel (None: chosen from the shapes)."""

    block_q: int | None = None  # query positions per program, for each head of the group (multiple of 8)
    block_k: int | None = None  # keys per step: whole pages, or an aligned slice of one page


def sublanes(dtype: Any) -> int:
    """Rows of one native VMEM tile of `dtype`: 8 for 32-bit types, 16 for 16-bit ones."""
    return 32 // jnp.dtype(dtype).itemsize


def check_pages(page_size: int, block_k: int, dtype: Any) -> None:
    """Page copies land on whole VMEM tiles: page_size and block_k tile by the sublanes and divide one another."""
    if jnp.dtype(dtype).itemsize < 2:
        raise ValueError(f"{jnp.dtype(dtype).name} K/V pages are not supported by the Mosaic TPU kernels "
                         "(8-bit pages need the Mosaic GPU or the reference backend)")
    tile = sublanes(dtype)
    if page_size % tile or block_k % tile:
        raise ValueError(f"page_size={page_size} and block_k={block_k} must be multiples of {tile} for "
                         f"{jnp.dtype(dtype).name} pages on Mosaic TPU")
    if (page_size < block_k and block_k % page_size) or (page_size > block_k and page_size % block_k):
        raise ValueError(f"page_size={page_size} and block_k={block_k} must divide one another")


def default_block_k(page_size: int, pages_per_row: int, target: int) -> int:
    """About `target` keys per step: whole pages (a slice of a large page), never past the table's row."""
    if page_size >= target:
        return math.gcd(page_size, target)
    return page_size * min(max(1, target // page_size), pages_per_row)


def page_copies(table_ref, row, kvh, pos, k_hbm, v_hbm, k_dst, v_dst, sem, *, pages_per_row: int) -> list[Any]:
    """The DMAs bringing keys [pos, pos + block_k) of `row` from its K and V pages into k_dst, v_dst.

    table_ref: [batch * pages_per_row] int32 in SMEM; k_hbm, v_hbm: [kv_heads, num_pages, page_size, hd];
    k_dst, v_dst: [block_k, hd] in VMEM; pos a multiple of block_k. Entries past the table's row and
    page numbers outside the pool are clamped: those keys lie past the row's length and are masked.
    """
    num_pages, ps = k_hbm.shape[1], k_hbm.shape[2]
    bk = k_dst.shape[0]

    def page(i):
        entry = table_ref[row * pages_per_row + jnp.minimum(i, pages_per_row - 1)]
        return jnp.clip(entry, 0, num_pages - 1)

    copies = []
    for src, dst in ((k_hbm, k_dst), (v_hbm, v_dst)):
        if ps >= bk:
            offset = pl.multiple_of(lax.rem(pos, ps), bk)
            copies.append(pltpu.make_async_copy(src.at[kvh, page(lax.div(pos, ps)), pl.ds(offset, bk)], dst, sem))
        else:
            for i in range(bk // ps):
                copies.append(pltpu.make_async_copy(src.at[kvh, page(lax.div(pos, ps) + i)], dst.at[pl.ds(i * ps, ps)], sem))
    return copies


def attend_blocks(q_ref, k_buf, v_buf, acc_ref, copies: Callable[[Any, Any], list[Any]], *, num_full, num_blocks,
                  kv_len, scale: float, visible: Callable[[Any], Any], softcap: float | None = None, first: Any = 0,
                  lo_full: Any = 0, kv_start: Any = 0) -> tuple[Any, Any]:
    """Online softmax of q_ref's rows over K/V blocks first .. num_blocks - 1, double-buffered.

    q_ref: [rows, hd]; k_buf, v_buf: [2, block_k, hd] VMEM; acc_ref: [rows, hd] f32 VMEM scratch,
    left holding the unnormalized output. copies(j, slot): the DMAs bringing block j into buffer
    `slot`. Blocks below lo_full (a window's edge) and from num_full on are masked: scores where not
    visible(j) ([rows, block_k] bool), and V rows at positions outside [kv_start, kv_len) (stale page
    contents, maybe NaN). Scores are soft-capped before masking. Returns the row max and the softmax
    denominator, both [rows, 1] f32.
    """
    rows, bk = q_ref.shape[0], k_buf.shape[1]
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    @pl.when(num_blocks > first)
    def _():
        for c in copies(first, lax.rem(first, 2)):
            c.start()

    def step(j, carry, *, masked: bool):
        m, denom = carry
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < num_blocks)
        def _():
            for c in copies(j + 1, 1 - slot):
                c.start()

        for c in copies(j, slot):
            c.wait()
        k, v = k_buf[slot], v_buf[slot]
        s = softcapped(lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32) * scale, softcap)
        if masked:
            s = jnp.where(visible(j), s, -jnp.inf)
            pos = j * bk + lax.broadcasted_iota(jnp.int32, v.shape, 0)
            v = jnp.where((pos >= kv_start) & (pos < kv_len), v, jnp.zeros_like(v))
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        denom = alpha * denom + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                                      preferred_element_type=jnp.float32)
        return m_new, denom

    acc_ref[...] = jnp.zeros_like(acc_ref)
    carry = (jnp.full((rows, 1), _NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    edge = jnp.clip(lo_full, first, jnp.maximum(num_blocks, first))
    full = jnp.clip(num_full, edge, jnp.maximum(num_blocks, edge))
    carry = lax.fori_loop(first, edge, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(edge, full, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full, num_blocks, functools.partial(step, masked=True), carry)


def _kernel(table_ref, q_start_ref, kv_len_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sem, acc_ref, *,
            causal: bool, scale: float, softcap: float | None, window: int | None, group: int, block_q: int,
            pages_per_row: int):
    # table_ref: [b * pages_per_row], q_start_ref, kv_len_ref: [b] (SMEM)
    # q_ref, o_ref: [group * block_q, hd], row g * block_q + i = head kvh * group + g at position q0 + i
    # k_hbm, v_hbm: [kv_heads, num_pages, page_size, hd] (HBM); k_buf, v_buf: [2, block_k, hd]; sem: DMA [2]
    # acc_ref: [group * block_q, hd] f32
    b, kvh, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk = k_buf.shape[1]
    kv_len = kv_len_ref[b]
    q0 = q_start_ref[b] + qi * block_q
    hi = jnp.minimum(kv_len, q0 + block_q) if causal else kv_len
    lo = jnp.minimum(kv_len, q0 + 1) if causal else kv_len  # keys below lo are visible to every row
    num_blocks = lax.div(jnp.maximum(hi, 0) + bk - 1, bk)  # lax.div: the operands are never negative
    num_full = jnp.minimum(lax.div(jnp.maximum(lo, 0), bk), num_blocks)

    def copies(j, slot):
        return page_copies(table_ref, b, kvh, j * bk, k_hbm, v_hbm, k_buf.at[slot], v_buf.at[slot], sem.at[slot],
                           pages_per_row=pages_per_row)

    def visible(j):
        shape = (group * block_q, bk)
        k_pos = j * bk + lax.broadcasted_iota(jnp.int32, shape, 1)
        seen = k_pos < kv_len
        pos = lax.broadcasted_iota(jnp.int32, (block_q, bk), 0)
        q_pos = q0 + (jnp.concatenate([pos] * group, axis=0) if group > 1 else pos)
        if causal:
            seen = seen & (k_pos <= q_pos)
        if window is not None:
            seen = seen & (k_pos > q_pos - window)
        return seen

    first, lo_full = window_blocks(q0, q0 + block_q - 1, window, bk, jnp.maximum(num_blocks, 1))
    _, denom = attend_blocks(q_ref, k_buf, v_buf, acc_ref, copies, num_full=num_full, num_blocks=num_blocks,
                             kv_len=kv_len, scale=scale, visible=visible, softcap=softcap, first=first,
                             lo_full=lo_full, kv_start=0 if window is None else q0 - window + 1)
    o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _call(q, k_pages, v_pages, table, q_start, kv_len, *, causal: bool, sm_scale, softcap, window, block_q: int,
          block_k: int, interpret):
    b, t, h, hd = q.shape
    kv, _, ps, _ = k_pages.shape
    group = h // kv
    if block_q % 8 or t % block_q:
        raise ValueError(f"q_len={t} must be a multiple of block_q={block_q}, itself a multiple of 8")
    check_pages(ps, block_k, k_pages.dtype)
    pages_per_row = table.shape[1]
    num_qt = t // block_q
    rows = group * block_q
    # [b, t, h, hd] -> [b, kv, t * group, hd]: each program's rows contiguous, head-major within its tile.
    q_tiles = q.astype(k_pages.dtype).reshape(b, num_qt, block_q, kv, group, hd).transpose(0, 3, 1, 4, 2, 5)
    q_tiles = q_tiles.reshape(b, kv, t * group, hd)
    tile = pl.BlockSpec((None, None, rows, hd), lambda bi, kvh, qi, *_: (bi, kvh, qi, 0))
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else float(sm_scale)
    kernel = pl.pallas_call(
        functools.partial(_kernel, causal=causal, scale=scale, softcap=softcap, window=window, group=group,
                          block_q=block_q, pages_per_row=pages_per_row),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, kv, num_qt),
            in_specs=[tile, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=tile,
            scratch_shapes=[
                pltpu.VMEM((2, block_k, hd), k_pages.dtype),
                pltpu.VMEM((2, block_k, hd), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, hd), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=backend_lib.interpret_params("mosaic_tpu", interpret),
    )
    out = kernel(table.astype(jnp.int32).reshape(-1), q_start.astype(jnp.int32), kv_len.astype(jnp.int32),
                 q_tiles, k_pages, v_pages)
    out = out.reshape(b, kv, num_qt, group, block_q, hd).transpose(0, 2, 4, 1, 3, 5)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def default_block_q(q_len: int, group: int, block_q: int | None) -> int:
    """About 256 query rows per program (group * block_q), at most 128 positions, dividing q_len.

    With block_k = 128, a step's scores are then [256, 128] float32: 32 of the 64 vector registers.
    """
    if block_q is not None:
        return block_q
    bq = min(128, max(8, 256 // group))
    while bq > 8 and q_len % bq:
        bq //= 2
    return bq


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, softcap: float | None = None,
                    window: int | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """Dense flash attention (see reference.flash_attention): K/V transposed once into pages of block_k keys."""
    bs = block_sizes or BlockSizes()
    b, t, h, hd = q.shape
    s, kv = k.shape[1], k.shape[2]
    bk = bs.block_k or math.gcd(s, 128)
    if s % bk:
        raise ValueError(f"kv_len={s} must be a multiple of block_k={bk}")

    def as_pages(x):  # [b, s, kv, hd] -> [kv, b * s // bk, bk, hd]: row b's pages are b * s // bk + j
        return x.transpose(2, 0, 1, 3).reshape(kv, b * (s // bk), bk, hd)

    table = jnp.arange(b * (s // bk), dtype=jnp.int32).reshape(b, s // bk)
    q_start = jnp.full((b,), s - t if causal else 0, jnp.int32)
    return _call(q, as_pages(k), as_pages(v), table, q_start, jnp.full((b,), s, jnp.int32), causal=causal,
                 sm_scale=sm_scale, softcap=softcap, window=window, block_q=default_block_q(t, h // kv, bs.block_q),
                 block_k=bk, interpret=interpret)


def paged_flash_attention(q, k_pages, v_pages, page_table, q_start, kv_lengths, *, causal: bool = True,
                          sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                          block_sizes: BlockSizes | None = None, interpret: bool | None = None) -> jax.Array:
    """Prefill chunk over K/V pages (see reference.paged_flash_attention), pages copied by DMA, never gathered."""
    bs = block_sizes or BlockSizes()
    kv, _, ps, _ = k_pages.shape
    block_k = bs.block_k or default_block_k(ps, page_table.shape[1], 128)
    return _call(q, k_pages, v_pages, page_table, q_start, kv_lengths, causal=causal, sm_scale=sm_scale,
                 softcap=softcap, window=window,
                 block_q=default_block_q(q.shape[1], q.shape[2] // kv, bs.block_q), block_k=block_k,
                 interpret=interpret)
