"""Paged decode attention for TPUs in Pallas Mosaic TPU: page DMAs into double-buffered VMEM.

One program owns one slot's KV head (the whole query group, padded to a VMEM tile of rows: K/V
are read once per group) and one split of its sequence. It copies the pages of each `block_k`-key
block from HBM through the page table (prefetched into SMEM), the next block's copies in flight
while this one is computed, with the flash kernel's online softmax (`attend_blocks`). Each split
writes a float32 partial and its log-sum-exp; with several splits, they are merged afterwards.
A TensorCore runs its programs in sequence, so splits only spread a short batch over the chip's
cores (two on a megacore chip). With a sliding window a split starts at its first block inside the
slot's window (one wholly behind it copies nothing and weighs nothing in the merge); the block the
window's edge crosses is masked. A soft-cap squashes the scores before any mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.mosaic_tpu import attend_blocks, check_pages, default_block_k, page_copies, sublanes
from pallas_kernels.paged_attention.reference import combine_splits

CORES = 2  # TensorCores sharing a chip's parallel grid dimensions (megacore); sets only the default split


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic TPU decode kernel (None: chosen from the shapes)."""

    block_k: int | None = None  # keys per step: whole pages, or an aligned slice of one page
    num_splits: int | None = None  # sequence splits per slot


def default_splits(batch: int, kv_heads: int, max_len: int, block_k: int) -> int:
    """Enough splits to give every core a program, where the sequences are long enough to share."""
    programs = batch * kv_heads
    if programs >= CORES:
        return 1
    return max(1, min(-(-CORES // programs), max_len // (4 * block_k)))


def _kernel(table_ref, len_ref, q_ref, k_hbm, v_hbm, o_ref, lse_ref, k_buf, v_buf, sem, acc_ref, *,
            scale: float, softcap: float | None, window: int | None, split_len: int, pages_per_row: int):
    # table_ref: [b * pages_per_row], len_ref: [b] (SMEM)
    # q_ref: [rows, hd], row r < group = query head kvh * group + r; o_ref: [rows, hd] f32; lse_ref: [rows, 1] f32
    # k_hbm, v_hbm: [kv_heads, num_pages, page_size, hd] (HBM); k_buf, v_buf: [2, block_k, hd]; sem: DMA [2]
    b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk = k_buf.shape[1]
    begin = split * split_len
    length = len_ref[b]
    n = jnp.clip(length - begin, 0, split_len)  # keys of this split
    num_blocks = lax.div(n + bk - 1, bk)

    def copies(j, slot):
        return page_copies(table_ref, b, kvh, begin + j * bk, k_hbm, v_hbm, k_buf.at[slot], v_buf.at[slot],
                           sem.at[slot], pages_per_row=pages_per_row)

    lowest = 0 if window is None else length - window  # the first position the window sees
    first = jnp.minimum(lax.div(jnp.maximum(lowest - begin, 0), bk), num_blocks)
    lo_full = lax.div(jnp.maximum(lowest - begin + bk - 1, 0), bk)

    def visible(j):
        pos = begin + j * bk + lax.broadcasted_iota(jnp.int32, (q_ref.shape[0], bk), 1)
        return (pos < length) & (pos >= lowest)

    m, denom = attend_blocks(q_ref, k_buf, v_buf, acc_ref, copies, num_full=lax.div(n, bk), num_blocks=num_blocks,
                             kv_len=length - begin, scale=scale, visible=visible, softcap=softcap, first=first,
                             lo_full=lo_full, kv_start=lowest - begin)
    o_ref[...] = acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)
    lse_ref[...] = m + jnp.log(denom)  # -inf for a split that saw no key


def reads_float8_pages(head_dim: int) -> bool:
    """8-bit pages are refused (check_pages)."""
    return False


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, sm_scale: float | None = None,
                    softcap: float | None = None, window: int | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """Decode attention over pages (see reference.paged_attention), pages copied by DMA, never gathered."""
    bs = block_sizes or BlockSizes()
    b, h, hd = q.shape
    kv, _, ps, _ = k_pages.shape
    group = h // kv
    pages_per_row = page_table.shape[1]
    bk = bs.block_k or default_block_k(ps, pages_per_row, 256)  # a few query rows: bigger copies
    check_pages(ps, bk, k_pages.dtype)
    max_len = pages_per_row * ps
    splits = bs.num_splits or default_splits(b, kv, max_len, bk)
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be at least 1")
    split_len = -(-max_len // splits)
    split_len = -(-split_len // bk) * bk
    splits = -(-max_len // split_len)
    rows = -(-group // sublanes(k_pages.dtype)) * sublanes(k_pages.dtype)
    q_rows = q.astype(k_pages.dtype).reshape(b, kv, group, hd)
    if rows > group:  # the matmul's rows fill a VMEM tile
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else float(sm_scale)
    kernel = pl.pallas_call(
        functools.partial(_kernel, scale=scale, softcap=softcap, window=window, split_len=split_len,
                          pages_per_row=pages_per_row),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kv, splits),
            in_specs=[pl.BlockSpec((None, None, rows, hd), lambda bi, kvh, split, *_: (bi, kvh, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec((None, None, None, rows, hd), lambda bi, kvh, split, *_: (bi, kvh, split, 0, 0)),
                       pl.BlockSpec((None, None, None, rows, 1), lambda bi, kvh, split, *_: (bi, kvh, split, 0, 0))],
            scratch_shapes=[
                pltpu.VMEM((2, bk, hd), k_pages.dtype),
                pltpu.VMEM((2, bk, hd), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, hd), jnp.float32),
            ],
        ),
        out_shape=(jax.ShapeDtypeStruct((b, kv, splits, rows, hd), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, splits, rows, 1), jnp.float32)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=backend_lib.interpret_params("mosaic_tpu", interpret),
    )
    o_part, lse_part = kernel(page_table.astype(jnp.int32).reshape(-1), lengths.astype(jnp.int32), q_rows,
                              k_pages, v_pages)
    o_part, lse = o_part[:, :, :, :group], lse_part[:, :, :, :group]  # [b, kv, splits, group, hd | 1]
    if splits == 1:
        return o_part[:, :, 0].reshape(b, h, hd).astype(q.dtype)
    return combine_splits(o_part, lse[..., 0]).reshape(b, h, hd).astype(q.dtype)
