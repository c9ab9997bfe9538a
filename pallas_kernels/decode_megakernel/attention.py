"""Attention in the megakernel, by the compute warpgroups of the program holding a query head: its K and V blocks of
128 positions come through the ring (producer.py: K, V, K, V, ... as bfloat16 views of the slots, a page at a time),
its q from the converter (converter.py). Compute warpgroup 0 runs the online softmax over the cached blocks, then
folds in the step's own K/V as one key more (they never go through the cache in the step that makes them: a tail
block read back cost 3.3 us a layer); warpgroup 1 only hands the slots back."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_megakernel.plan import BATCH, BLOCK_N, LOG2E, STAGES
from pallas_kernels.decode_megakernel.program import Program, load_t
from pallas_kernels.flash_attention.mosaic_gpu import mma_transposed, online_softmax, with_layout, zero_rows_from
from pallas_kernels.paged_attention.mosaic_gpu import mma_values_transposed
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu


def _finish(pr: Program, layer, j, m, denom, acc):
    """The fold of the new token's K/V, then the head's output stored to attention's sums. The fold's score q·k is
    elementwise products and one sum across the warpgroup, then the online softmax's update for one key (a wgmma on a
    64-key tile and the softmax of a block cost ~3 us a layer)."""
    s, hd, rows = pr.scratch, pr.config.model.head_dim, qmm_gpu.ROWS
    halves = [acc[at:at + rows] for at in range(0, hd, rows)]
    c = hd ** -0.5 * LOG2E
    plgpu.barrier_wait(s.fold_bar)

    def folded(i, at):  # the converter's [64, queries] half at `at` of q (0), k (1) or v (2)
        return load_t(s.fold_smem.at[i, :, pl.ds(at, rows)])
    ats = range(0, hd, rows)
    q_k = [folded(0, at) * folded(1, at) for at in ats]
    score = jnp.sum(functools.reduce(jnp.add, q_k), axis=0) * c  # [queries]
    m_new = jnp.maximum(m, score)
    alpha, p_new = jnp.exp2(m - m_new), jnp.exp2(score - m_new)
    denom = denom * alpha + p_new
    halves = [h * lax.broadcast_in_dim(alpha, h.shape, [1]) + folded(2, at) * lax.broadcast_in_dim(p_new, h.shape, [1])
              for at, h in zip(ats, halves)]
    denom = jnp.where(denom == 0.0, 1.0, denom)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for at, h in zip(range(0, hd, rows), halves):
        qmm_gpu.store_transposed(h / lax.broadcast_in_dim(denom, h.shape, [1]), s.ao_smem.at[:, pl.ds(at, rows)],
                                 interpreted=False)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.ao_smem.at[pl.ds(0, BATCH)],
                            pr.refs.sums[j].at[layer, pl.ds(0, BATCH), pl.ds(pr.p * hd, hd)])
    plgpu.wait_smem_to_gmem(0)


def _online_softmax(pr: Program, layer, j, slot_of, begin):
    """Warpgroup 0: scores K·qᵀ and Vᵀ·P by wgmma over the head's blocks, positions past the length masked (and the
    last block's V rows past it zeroed: stale, maybe NaN), then _finish."""
    s, hd = pr.scratch, pr.config.model.head_dim
    col_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(0), interpreted=False)
    queries = s.q_smem.shape[0]
    m = col_vec(jnp.full((queries,), -1e30, jnp.float32))
    denom = col_vec(jnp.zeros((queries,), jnp.float32))
    acc = with_layout(jnp.zeros((hd, queries), jnp.float32), plgpu.Layout.WGMMA, interpreted=False)
    key = with_layout(lax.broadcasted_iota(jnp.int32, (BLOCK_N, queries), 0), plgpu.Layout.WGMMA, interpreted=False)
    c = hd ** -0.5 * LOG2E

    def block(blk, carry):
        m, denom, acc = carry
        k_slot, v_slot = slot_of(begin + 2 * blk), slot_of(begin + 2 * blk + 1)
        plgpu.barrier_wait(s.tile_bar.at[k_slot])
        plgpu.barrier_wait(s.kv_bar.at[k_slot])
        scores = mma_transposed(pr.k_view.at[k_slot], s.q_smem, interpreted=False)  # [keys, queries]
        plgpu.barrier_arrive(s.free_bar.at[k_slot])
        scores = jnp.where(key + blk * BLOCK_N < pr.length, scores, -jnp.inf)  # past the length: none
        probs, m, denom, alpha = online_softmax(scores, m, denom, c, axis=0)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
        plgpu.commit_smem()  # (a warpgroup barrier: every warp's part of the block before's Vᵀ·P wgmma, which reads
        # all of P, is done before P is stored again)
        s.p_smem[...] = probs.astype(s.p_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(s.tile_bar.at[v_slot])
        plgpu.barrier_wait(s.kv_bar.at[v_slot])
        short = pr.length - blk * BLOCK_N  # positions in this block, if it is the last
        pl.when(short < BLOCK_N)(functools.partial(zero_rows_from, pr.v_view.at[v_slot], short, interpreted=False))
        acc = mma_values_transposed(acc, pr.v_view.at[v_slot], s.p_smem, interpreted=False)
        plgpu.barrier_arrive(s.free_bar.at[v_slot])
        return m, denom, acc

    m, denom, acc = lax.fori_loop(0, pr.blocks, block, (m, denom, acc))
    _finish(pr, layer, j, m, denom, acc)


def attend(pr: Program, layer, j, begin, g0) -> None:
    """Head p's units of attention (phase j), from ring step g0 on, by the compute warpgroups; then its tile
    counted."""
    s = pr.scratch

    def slot_of(u):
        return lax.rem(g0 + u - begin, STAGES)

    pl.when(pr.wg == 0)(lambda: _online_softmax(pr, layer, j, slot_of, begin))

    @pl.when(pr.wg == 1)
    def _():
        def hand_back(i, c):
            plgpu.barrier_wait(s.tile_bar.at[slot_of(begin + i)])
            plgpu.barrier_arrive(s.free_bar.at[slot_of(begin + i)])
            return c

        lax.fori_loop(0, pr.att_units, hand_back, None)

    pr.signal_done(layer, j, pr.p)
