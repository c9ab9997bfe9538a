"""Paged decode attention for Hopper in Pallas Mosaic GPU: TMA page copies in a ring, wgmma.

One program owns one slot's KV head (the whole query group: K/V are read once per group) and one
split of its sequence, or, when there are about twice as many (slot, KV head) pairs as SMs, two slots
in turn: the K/V ring then streams on from the first slot's last block into the second's first.
A producer warpgroup copies the pages of each `block_k`-token block into a ring of `stages` buffers;
the compute warpgroup runs Q·Kᵀ and P·V on the tensor cores with the group's rows padded to the
wgmma M of 64 (decode is bandwidth-bound: the idle rows cost no bytes).
Queries are read straight from q viewed as [batch * heads, head_dim]: TMA into 8-row tiles needs an
8-aligned first row, so a program loads the aligned rows around its group (a neighbour's queries
ride along and are dropped) and writes back only its own rows. No copy of q or of the output is made
around the kernel unless batch * heads is not a multiple of 8.
With several splits, each writes a float32 partial and its log-sum-exp, combined afterwards.
In the block that crosses a slot's length, V's rows past it are zeroed in shared memory before
P·V, so stale page contents (even NaN) never reach the output.
With a sliding window each split starts at its first block inside the slot's window (a split wholly behind it
runs no block and weighs nothing in the combine), and the block the window's edge crosses is masked, its V
rows behind the window zeroed too (a page released behind the window may hold another request's values);
a soft-cap squashes the scores before any mask.
float8_e4m3fn pages travel 8-bit into the ring and become float16 tensor-core operands in shared
memory; by default a third warpgroup does that conversion one block ahead of the compute warpgroup
(`BlockSizes.convert_warpgroup`, `float8_block_sizes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.mosaic_gpu import (
    ROWS,
    converted,
    mma_accumulate,
    mma_transforms,
    mma_transposed,
    online_softmax,
    operand_dtypes,
    reads_float8_pages,  # noqa: F401  (this backend's answer to paged_attention.reads_float8_pages)
    softcapped,
    with_layout,
    zero_rows_from,
)
from pallas_kernels.paged_attention.reference import combine_splits

_NEG = -1e30
QN = 16  # query rows of a transposed program: the wgmma N
CONVERTED_TILES = 2  # float16 K (and V) tiles of a converting warpgroup: it works one block ahead
CONVERTER_REGISTERS = 112  # per thread of the converting warpgroup: 64 x head_dim values at a time


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic GPU decode kernel."""

    block_k: int = 128  # tokens per pipeline step (best on the H100 sweep at batch >= 32)
    stages: int = 2  # K/V buffers in the ring
    num_splits: int | None = None  # sequence splits per slot; None picks enough to fill the chip
    # batch slots one program runs in turn (1 or 2: each needs its own query and output tiles);
    # None: 2 when that still leaves a program for nearly every SM, so a second wave's start-up is saved
    slots_per_program: int | None = None
    # 8-bit pages: a third warpgroup converts the ring's tiles into a ring of two float16 tiles while the
    # compute warpgroup works on the previous block (False: the compute warpgroup converts them itself)
    convert_warpgroup: bool = False
    # Scores as K·qᵀ: the block's keys are the wgmma M and the query group (up to 16 rows) its N, so the softmax
    # works on block_k x 16 values instead of 64 x block_k; P goes through shared memory and the output comes
    # out transposed. V's tiles then take a 32-byte swizzle (wgmma wants P's, and a 16-wide tile allows no more).
    transposed: bool = False


def mma_values_transposed(acc: jax.Array, v_ref: Any, p_ref: Any, *, interpreted: bool) -> jax.Array:
    """acc + v_refᵀ @ p_ref: oᵀ [hd, 16] += Vᵀ [hd, bk] · P [bk, 16], by wgmma with V as the transposed A."""
    if interpreted:
        return acc + lax.dot_general(v_ref[...], p_ref[...], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    def accumulate(ref):
        plgpu.wgmma(ref, v_ref.transpose((1, 0)), p_ref)

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def default_splits(batch: int, kv_heads: int, max_len: int, block_k: int) -> int:
    """Sequence splits per (slot, KV head) asked for: about one wave of programs over the SMs, at most one per
    block. `split_layout` rounds each split up to whole blocks, which can leave fewer splits than asked: at
    batch 1 and 1,504 tokens, 11 asked become 6 of two 128-token blocks (48 programs).
    On the H100 this beat two waves of at least four blocks a split (the 8B
    decode step at batch 1: 6.41 against 6.57 ms, both rules in one process). Keeping the whole-block count
    (12 splits of one block there) made the kernel 22 us per step faster but the step 0.6 % slower: the
    combine then reads twice the partials."""
    programs = batch * kv_heads
    if programs >= backend_lib.num_sms():
        return 1
    return max(1, min(-(-backend_lib.num_sms() // programs), max_len // block_k))


def split_layout(batch: int, kv_heads: int, max_len: int, bs: BlockSizes) -> tuple[int, int]:
    """(splits, tokens per split) of a call: the asked or default count, each split rounded up to whole blocks."""
    splits = bs.num_splits or (1 if bs.slots_per_program == 2 else default_splits(batch, kv_heads, max_len, bs.block_k))
    blocks_per_split = -(-max_len // (splits * bs.block_k))
    split_len = blocks_per_split * bs.block_k
    return -(-max_len // split_len), split_len


SMEM_BYTES = 227 * 1024  # shared memory one H100 block may use
# Beside the tiles: barriers and each buffer's alignment. Calibrated on the H100 and the CUDA lowering: the
# converting warpgroup's 128-token tiling (tiles of 229,376 bytes) runs; head_dim 256 split over 64-token blocks
# (229,376 bytes of tiles and 256 of log-sum-exp, then allocated ahead of the converted tiles) needed 232,520.
SMEM_RESERVE = 3 * 1024


def smem_bytes(slots: int, hd: int, bs: BlockSizes, itemsize: int, partial: bool = False, kv_itemsize: int = 0) -> int:
    """Shared memory of one program: its query and output tiles per slot (float32 output for split partials),
    the K/V ring, and with 8-bit pages (`kv_itemsize` 1) the K and V tiles converted for the tensor cores
    (one of each, or two with a converting warpgroup)."""
    out_itemsize = 4 if partial else itemsize
    kv_itemsize = kv_itemsize or itemsize
    depth = CONVERTED_TILES if bs.convert_warpgroup else 1
    staged = depth * 2 * bs.block_k * hd * itemsize if kv_itemsize < itemsize else 0
    rows = QN if bs.transposed else ROWS
    lse = rows * 4 if partial else 0
    p_tile = bs.block_k * QN * itemsize if bs.transposed else 0
    return (slots * rows * hd * (itemsize + out_itemsize) + 2 * bs.stages * bs.block_k * hd * kv_itemsize + staged
            + lse + p_tile + SMEM_RESERVE)


def resolve(bs: BlockSizes, batch: int, kv_heads: int, max_len: int, hd: int, itemsize: int,
            kv_itemsize: int) -> tuple[int, int, int, int]:
    """(splits, tokens per split, slots per program, shared memory in bytes) of a call under tiling `bs`."""
    splits, split_len = split_layout(batch, kv_heads, max_len, bs)
    slots = bs.slots_per_program or default_slots(batch, kv_heads, splits, hd, bs, itemsize, kv_itemsize)
    return splits, split_len, slots, smem_bytes(slots, hd, bs, itemsize, partial=splits > 1, kv_itemsize=kv_itemsize)


def float8_block_sizes(batch: int, kv_heads: int, group: int, max_len: int, hd: int, itemsize: int) -> BlockSizes:
    """Default tiling over 8-bit pages: a converting warpgroup over 128-token blocks, one slot a program, in the
    first layout that fits in shared memory: query rows (unsplit sequences at head_dim 128), else scores as K·qᵀ
    (split sequences too: their float32 partials take 16 rows, not 64). On the H100 (against the compute
    warpgroup converting) the first ran 1.24x (batch 256, 1,536 tokens), 1.28x (128, 2,048)
    and 1.30x (32, 8,192) faster, 3-5 % ahead of the second there; the second 1.23x at batch 8 (8,192 tokens,
    split; at batch 1 its 1.13x is within that run's noise). Elsewhere (wider heads, groups whose 8-aligned load
    exceeds 16 rows: 11, 13-15 and over 16) the compute warpgroup converts, in the first of
    the default tiling and 64-token blocks that fits (none does for a split sequence at head_dim 256: the call
    then names the shared memory it needs)."""
    converting = BlockSizes(block_k=128, stages=2, slots_per_program=1, convert_warpgroup=True)
    candidates = (converting, *([dataclasses.replace(converting, transposed=True)] if query_rows(group) <= QN else []),
                  BlockSizes(), BlockSizes(block_k=64, stages=2))
    for bs in candidates:
        if resolve(bs, batch, kv_heads, max_len, hd, itemsize, 1)[3] <= SMEM_BYTES:
            return bs
    return candidates[-1]  # the call names the shared memory it would need


def default_slots(batch: int, kv_heads: int, splits: int, hd: int, bs: BlockSizes, itemsize: int,
                  kv_itemsize: int = 0) -> int:
    fits = smem_bytes(2, hd, bs, itemsize, kv_itemsize=kv_itemsize) <= SMEM_BYTES
    return 2 if fits and splits == 1 and -(-batch // 2) * kv_heads >= backend_lib.num_sms() * 15 // 16 else 1


def query_rows(group: int) -> int:
    """Rows a program loads: an 8-aligned run that holds its group wherever the group starts."""
    if group % 8 == 0:
        return group
    return -(-(group + 8 - math.gcd(group, 8)) // 8) * 8


def first_row(start, total: int, rows: int, xp=jnp):
    """The 8-aligned first of `rows` loaded rows holding the group that starts at row `start` (of `total`);
    `xp=np` for offsets known when tracing (under a trace, jnp stages even constant operands)."""
    return xp.minimum(start // 8 * 8, total - rows)


def _kernel(q_ref, k_ref, v_ref, table_ref, len_ref, *refs, scale: float, softcap: float | None, window: int | None,
            group: int, rows: int, split_len: int, slots: int, bs: BlockSizes, partial: bool, staged: bool,
            interpreted: bool):
    # q_ref: [n >= b * heads, hd] the queries, head-major per slot (n a multiple of 8)
    # k_ref, v_ref: [kv_heads, pages, ps, hd]; table_ref: [b, pages_per_row]; len_ref: [b]
    # outputs: o [n, hd] or (o [b, kv_heads, splits, group, hd] f32, lse [b, kv_heads, splits, 64] f32); transposed
    # (bs.transposed): o [b, kv_heads, hd, 16] or (o [b, kv_heads, splits, hd, 16] f32, lse [b, kv_heads, splits, 16])
    # rows: query_rows(group); row `offset + r` of a q tile holds query head kvh * group + r for r < group
    # slots: consecutive batch slots this program runs one after another, its K/V ring streaming across them
    # 8-bit pages land in the ring as they are; the compute warpgroup converts each tile into k_stage or
    # v_stage (the tensor-core operands), then hands the ring slot back. With bs.convert_warpgroup a third
    # warpgroup does that instead, one block ahead, into k_stage/v_stage rings of two: it hands each
    # converted tile over through k_ready/v_ready and reuses it once the compute warpgroup arrives on
    # k_done/v_done.
    o_ref, *refs = refs
    lse_ref, *refs = refs if partial else (None, *refs)
    q_smem, k_smem, v_smem, o_smem, *refs = refs
    p_smem, *refs = refs if bs.transposed else (None, *refs)
    k_stage, v_stage, *refs = refs if staged else (None, None, *refs)
    lse_smem, *refs = refs if partial else (None, *refs)
    q_bar, k_bar, v_bar, k_free, v_free, *refs = refs
    convert = staged and bs.convert_warpgroup
    k_ready, v_ready, k_done, v_done = refs if convert else (None,) * 4
    assert slots == 1 or not partial, "split partials have no past-the-batch guard: one slot per program"
    bk, stages = bs.block_k, bs.stages
    kv_heads, batch = k_ref.shape[0], len_ref.shape[0]
    kvh = lax.axis_index("kvh")
    split = lax.axis_index("split")
    wg = lax.axis_index("wg")
    ps = k_ref.shape[2]
    last_entry, last_page = table_ref.shape[1] - 1, k_ref.shape[1] - 1
    begin = split * split_len

    def slot_of(i):
        """Batch slot of this program's i-th slot, its length, the first position its window sees, and its K/V
        blocks in this split: the first, the end, the first wholly in the window and the end of the full ones
        (past the batch: no blocks)."""
        b = jnp.minimum(lax.axis_index("b") * slots + i, batch - 1)
        length = jnp.where(lax.axis_index("b") * slots + i < batch, len_ref[b], 0)
        end = jnp.minimum(length, begin + split_len)
        num_blocks = jnp.maximum(end - begin + bk - 1, 0) // bk
        num_full = jnp.maximum(end - begin, 0) // bk
        lowest = 0 if window is None else length - window
        first = jnp.minimum(jnp.maximum(lowest - begin, 0) // bk, num_blocks)
        lo_full = jnp.clip((lowest - begin + bk - 1) // bk, first, num_blocks)
        return b, length, lowest, first, num_blocks, lo_full, jnp.clip(num_full, lo_full, num_blocks)

    def fetch(src, dst, barrier, b, j):
        pos = begin + j * bk
        if ps >= bk:
            page = jnp.clip(table_ref[b, jnp.minimum(pos // ps, last_entry)], 0, last_page)
            plgpu.copy_gmem_to_smem(src.at[kvh, page, pl.ds(pos % ps, bk)], dst, barrier)
        else:
            for i in range(bk // ps):
                page = jnp.clip(table_ref[b, jnp.minimum(pos // ps + i, last_entry)], 0, last_page)
                plgpu.copy_gmem_to_smem(src.at[kvh, page], dst.at[pl.ds(i * ps, ps)], barrier)

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        count = jnp.int32(0)  # blocks issued so far, over all of this program's slots: the ring position
        for i in range(slots):
            b, _, _, first, num_blocks, _, _ = slot_of(i)

            def step(j, carry, b=b, base=count - first):
                c = base + j
                slot = lax.rem(c, stages)

                @pl.when(c >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                    plgpu.barrier_wait(v_free.at[slot])

                fetch(k_ref, k_smem.at[slot], k_bar.at[slot], b, j)
                fetch(v_ref, v_smem.at[slot], v_bar.at[slot], b, j)
                return carry

            lax.fori_loop(first, num_blocks, step, None)
            count = count + num_blocks - first

        def drain(c, carry):
            slot = lax.rem(c, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            return carry

        lax.fori_loop(jnp.maximum(count - stages, 0), count, drain, None)

    if convert:
        @pl.when(wg == 2)
        def _converter():
            plgpu.set_max_registers(CONVERTER_REGISTERS, action="decrease")
            count = jnp.int32(0)
            for i in range(slots):
                _, _, _, first, num_blocks, _, _ = slot_of(i)

                def step(j, carry, base=count - first):
                    c = base + j
                    slot, st = lax.rem(c, stages), lax.rem(c, CONVERTED_TILES)

                    @pl.when(c >= CONVERTED_TILES)
                    def _():
                        plgpu.barrier_wait(k_done.at[st])
                        plgpu.barrier_wait(v_done.at[st])

                    for ring, bar, free, stage, ready in ((k_smem, k_bar, k_free, k_stage, k_ready),
                                                          (v_smem, v_bar, v_free, v_stage, v_ready)):
                        plgpu.barrier_wait(bar.at[slot])
                        converted(ring.at[slot], stage.at[st], free.at[slot], interpreted=interpreted, rows=ROWS)
                        plgpu.barrier_arrive(ready.at[st])
                    return carry

                lax.fori_loop(first, num_blocks, step, None)
                count = count + num_blocks - first

            def drain(c, carry):
                plgpu.barrier_wait(k_done.at[lax.rem(c, CONVERTED_TILES)])
                plgpu.barrier_wait(v_done.at[lax.rem(c, CONVERTED_TILES)])
                return carry

            lax.fori_loop(jnp.maximum(count - CONVERTED_TILES, 0), count, drain, None)

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        offsets = []
        for i in range(slots):  # every query tile is requested up front
            b = slot_of(i)[0]
            start = (b * kv_heads + kvh) * group
            row0 = pl.multiple_of(first_row(start, q_ref.shape[0], rows), 8)  # TMA into 8-row tiles: aligned rows
            offsets.append((start, start - row0))
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, rows)], q_smem.at[i, pl.ds(0, rows)], q_bar.at[i])
        wgmma = functools.partial(with_layout, layout=plgpu.Layout.WGMMA, interpreted=interpreted)
        row_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(1), interpreted=interpreted)
        tr = bs.transposed
        col_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(0), interpreted=interpreted)
        # each score's key within the block: along the rows of sᵀ = K·qᵀ, the columns of s = q·Kᵀ
        key = wgmma(lax.broadcasted_iota(jnp.int32, (bk, QN), 0) if tr else lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1))
        hd = q_smem.shape[-1]
        count = jnp.int32(0)

        def operand(ring, bar, stage, free, ready, slot, st):
            """The block's K or V tile for the tensor cores, once it has landed (and been converted)."""
            if convert:
                plgpu.barrier_wait(ready.at[st])
                return stage.at[st]
            plgpu.barrier_wait(bar.at[slot])
            return converted(ring.at[slot], stage, free.at[slot], interpreted=interpreted) if staged else ring.at[slot]

        def release(free, done, slot, st):
            """The tile's buffer may be refilled: its product has been read back."""
            if convert:
                plgpu.barrier_arrive(done.at[st])
            elif not staged:
                plgpu.barrier_arrive(free.at[slot])

        for i in range(slots):
            b, length, lowest, first, num_blocks, lo_full, num_full = slot_of(i)
            start, offset = offsets[i]
            q_tile = q_smem.at[i]
            plgpu.barrier_wait(q_bar.at[i])

            def step(j, carry, *, masked: bool, base=count - first, length=length, lowest=lowest, q_tile=q_tile):
                m, denom, acc = carry
                slot, st = lax.rem(base + j, stages), lax.rem(base + j, CONVERTED_TILES)
                k_operand = functools.partial(operand, k_smem, k_bar, k_stage, k_free, k_ready, slot, st)
                v_operand = functools.partial(operand, v_smem, v_bar, v_stage, v_free, v_ready, slot, st)
                if masked:  # the block crossing the slot's length (or the window's edge): V outside may be stale NaN
                    v_tile = v_operand()
                    zero_rows_from(v_tile, length - begin - j * bk, interpreted=interpreted,
                                   below=None if window is None else lowest - begin - j * bk)
                # s = q·Kᵀ [64, bk], or transposed sᵀ = K·qᵀ [bk, 16]: keys along `axis`
                s = mma_transposed(k_operand(), q_tile, interpreted=interpreted) if tr else \
                    mma_transposed(q_tile, k_operand(), interpreted=interpreted)
                release(k_free, k_done, slot, st)
                s, factor = softcapped(s, softcap, scale)
                if masked:
                    pos = begin + j * bk + key
                    s = jnp.where((pos < length) & (pos >= lowest), s, -jnp.inf)
                p, m, denom, alpha = online_softmax(s, m, denom, factor, axis=0 if tr else 1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1 if tr else 0])
                if not masked:
                    v_tile = v_operand()
                if tr:  # oᵀ += Vᵀ·P, P from shared memory (the last block's V·P was awaited: free to overwrite)
                    p_smem[...] = p.astype(p_smem.dtype)
                    plgpu.commit_smem()
                    acc = mma_values_transposed(acc, v_tile, p_smem, interpreted=interpreted)
                else:
                    acc = mma_accumulate(acc, p.astype(q_smem.dtype), v_tile, interpreted=interpreted)
                release(v_free, v_done, slot, st)
                return m, denom, acc

            vec = col_vec if tr else row_vec
            n_q = QN if tr else ROWS
            m = vec(jnp.full((n_q,), _NEG, jnp.float32))
            denom = vec(jnp.full((n_q,), 0.0, jnp.float32))
            acc = wgmma(jnp.full((hd, QN) if tr else (ROWS, hd), 0.0, jnp.float32))
            carry = lax.fori_loop(first, lo_full, functools.partial(step, masked=True), (m, denom, acc))
            carry = lax.fori_loop(lo_full, num_full, functools.partial(step, masked=False), carry)
            m, denom, acc = lax.fori_loop(num_full, num_blocks, functools.partial(step, masked=True), carry)
            count = count + num_blocks - first
            out = acc / lax.broadcast_in_dim(jnp.where(denom == 0.0, 1.0, denom), acc.shape, [1 if tr else 0])
            o_smem.at[i][...] = out.astype(o_smem.dtype)
            if partial:
                lse_smem[...] = m + jnp.log2(denom)
            plgpu.commit_smem()
            # transposed: the whole [hd, 16] tile out, the group's columns picked after the call; else its rows
            src = o_smem.at[i] if tr else o_smem.at[i, pl.ds(offset, group)]
            if partial:
                plgpu.copy_smem_to_gmem(src, o_ref.at[b, kvh, split])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kvh, split])
            else:
                dst = o_ref.at[b, kvh] if tr else o_ref.at[pl.ds(start, group)]

                @pl.when(lax.axis_index("b") * slots + i < batch)
                def _(src=src, dst=dst):
                    plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0)


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, sm_scale: float | None = None,
                    softcap: float | None = None, window: int | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """Decode attention over pages (see reference.paged_attention), pages read by TMA, never gathered."""
    b, h, hd = q.shape
    kv, _, ps, _ = k_pages.shape
    group = h // kv
    pages_per_row = page_table.shape[1]
    dtype, kv_dtype = operand_dtypes(q.dtype, k_pages.dtype, v_pages.dtype, hd)
    staged = kv_dtype != dtype
    itemsize, kv_itemsize = jnp.dtype(dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    max_len = pages_per_row * ps
    if block_sizes is None and staged:
        block_sizes = float8_block_sizes(b, kv, group, max_len, hd, itemsize)
    bs = block_sizes or BlockSizes()
    if hd % 64 or hd > 256:
        raise ValueError(f"head_dim={hd} must be a multiple of 64 and at most 256 for Mosaic GPU")
    if group > 32:
        raise ValueError(f"the GQA group heads//kv_heads={group} must be at most 32 for Mosaic GPU")
    if bs.transposed and query_rows(group) > QN:
        raise ValueError(f"transposed scores take at most {QN} query rows: the GQA group heads//kv_heads={group} "
                         f"loads {query_rows(group)}")
    if ps % 8 or (ps < bs.block_k and bs.block_k % ps) or (ps > bs.block_k and ps % bs.block_k):
        raise ValueError(f"page_size={ps} and block_k={bs.block_k} must divide one another (and page_size % 8 == 0)")
    if bs.block_k % 64:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of 64")
    splits, split_len, slots, need = resolve(bs, b, kv, max_len, hd, itemsize, kv_itemsize)
    # head_dim 256 (Gemma): two 128-token stages do not fit in shared memory; smaller blocks, then one stage, do
    for smaller in ((64, bs.stages), (64, 1)) if need > SMEM_BYTES and block_sizes is None and ps <= 64 else ():
        bs = dataclasses.replace(bs, block_k=smaller[0], stages=smaller[1])
        splits, split_len, slots, need = resolve(bs, b, kv, max_len, hd, itemsize, kv_itemsize)
        if need <= SMEM_BYTES:
            break
    if slots not in (1, 2) or (slots > 1 and splits > 1):
        raise ValueError(f"slots_per_program={slots} must be 1 or 2, and 1 when the sequence is split ({splits=})")
    if need > SMEM_BYTES:
        raise ValueError(f"slots_per_program={slots}, stages={bs.stages} and block_k={bs.block_k} at head_dim={hd} "
                         f"need {need} bytes of shared memory, more than {SMEM_BYTES}")
    rows = query_rows(group)
    q_rows = q.astype(dtype).reshape(b * h, hd)  # a view: heads are already grouped by KV head
    n_rows = max(-(-(b * h) // 8) * 8, rows)
    if n_rows > b * h:  # one small copy, only when the aligned loads would run past the end
        q_rows = jnp.pad(q_rows, ((0, n_rows - b * h), (0, 0)))
    params = backend_lib.interpret_params("mosaic_gpu", interpret)
    partial = splits > 1
    tr = mma_transforms(dtype)
    barriers = (
        plgpu.Barrier(num_arrivals=1, num_barriers=slots),
        plgpu.Barrier(num_arrivals=max(1, bs.block_k // ps), num_barriers=bs.stages),
        plgpu.Barrier(num_arrivals=max(1, bs.block_k // ps), num_barriers=bs.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=bs.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=bs.stages),
    )
    convert = staged and bs.convert_warpgroup
    if convert:  # k_ready, v_ready, k_done, v_done over the two converted tiles
        barriers = (*barriers, *(plgpu.Barrier(num_arrivals=1, num_barriers=CONVERTED_TILES) for _ in range(4)))
    kv_tr = mma_transforms(kv_dtype)
    transposed, n_q = bs.transposed, (QN if bs.transposed else ROWS)
    # Transposed, V·P's two shared-memory operands take P's 32-byte swizzle: V's ring (or its converted tiles)
    p_tr = (plgpu.TilingTransform((8, 32 // itemsize)), plgpu.SwizzleTransform(32))
    o_dtype = jnp.float32 if partial else dtype
    smem = (
        plgpu.SMEM((slots, n_q, hd), dtype, transforms=tr),
        plgpu.SMEM((bs.stages, bs.block_k, hd), kv_dtype, transforms=kv_tr),
        plgpu.SMEM((bs.stages, bs.block_k, hd), kv_dtype, transforms=p_tr if transposed and not staged else kv_tr),
        plgpu.SMEM((slots, hd, QN) if transposed else (slots, ROWS, hd), o_dtype),
    )
    if partial:
        out_type = (jax.ShapeDtypeStruct((b, kv, splits, hd, QN) if transposed else (b, kv, splits, group, hd),
                                         jnp.float32),
                    jax.ShapeDtypeStruct((b, kv, splits, n_q), jnp.float32))
    else:
        out_type = jax.ShapeDtypeStruct((b, kv, hd, QN) if transposed else (n_rows, hd), dtype)
    if transposed:
        smem = (*smem, plgpu.SMEM((bs.block_k, QN), dtype, transforms=p_tr))
    if staged:
        depth = (CONVERTED_TILES,) if convert else ()
        smem = (*smem, *(plgpu.SMEM((*depth, bs.block_k, hd), dtype, transforms=t)
                         for t in (tr, p_tr if transposed else tr)))
    if partial:  # last: a small tile ahead of a swizzled one would cost up to 1 KB of alignment
        smem = (*smem, plgpu.SMEM((n_q,), jnp.float32))
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else float(sm_scale)
    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, softcap=softcap, window=window, group=group, rows=rows,
                          split_len=split_len, slots=slots, bs=bs, partial=partial, staged=staged,
                          interpreted=params is not None),
        out_type=out_type,
        scratch_types=(*smem, *barriers),
        grid=(-(-b // slots), kv, splits),
        grid_names=("b", "kvh", "split"),
        num_threads=3 if convert else 2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=params,
    )
    k_pages, v_pages = k_pages.astype(kv_dtype), v_pages.astype(kv_dtype)
    out = kernel(q_rows, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32))
    if not partial and not transposed:
        out = out if n_rows == b * h else out[:b * h]
        return out.reshape(b, h, hd).astype(q.dtype)
    starts = (np.arange(b)[:, None] * kv + np.arange(kv)[None, :]) * group
    offsets = starts - first_row(starts, n_rows, rows, np)  # where each group sits in its loaded rows
    pick = functools.partial(group_columns, offsets=offsets, group=group)
    if not partial:  # [b, kv, hd, 16] -> the group's columns, transposed back: [b, kv, group, hd]
        return jnp.swapaxes(pick(out), -1, -2).reshape(b, h, hd).astype(q.dtype)
    o_part, lse_part = out
    if transposed:
        o_part = jnp.swapaxes(pick(o_part), -1, -2)
    o = combine_splits(o_part, pick(lse_part), base2=True)
    return o.reshape(b, h, hd).astype(q.dtype)


def group_columns(x: jax.Array, *, offsets: np.ndarray, group: int) -> jax.Array:
    """x [b, kv, ..., rows] with each program's group at offsets[b, kv] along the last axis -> [..., group].
    The offsets are known here, and few differ (a group starts at most 8 rows into its load): a select among
    static slices fuses into what follows, where a gather by the offsets was a kernel of its own."""
    out = None
    for off in np.unique(offsets):
        piece = x[..., off:off + group]
        mask = jnp.asarray(offsets == off).reshape(offsets.shape + (1,) * (x.ndim - 2))
        out = piece if out is None else jnp.where(mask, piece, out)
    return out
