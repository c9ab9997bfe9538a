"""The megakernel's producer warpgroup: every copy into a program's ring. For each unit of its runs, in ring order,
the unit's weight tile (attention: a K or V block, a page at a time) and, once the tiles its inputs come from are
counted done, the sums its activations are made of, staged for the converter (converter.py)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_megakernel.plan import BATCH, BLOCK_K, BLOCK_N, NORMED, PRODUCER_REGISTERS, STAGES, qkv_tiles
from pallas_kernels.decode_megakernel.program import Program
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu


def _sources(pr: Program, j, k_at):
    """(phase, tile) whose pieces a unit of phase j with inputs at k_at waits for."""
    cfg, name = pr.config.model, pr.config.phases[j].name
    if name == "wqkv":  # the down tiles of the layer before
        return [(len(pr.config.phases) - 1, lax.div(k_at, BLOCK_N) + i) for i in range(BLOCK_K // BLOCK_N)]
    if name == "attn":  # head p: its q tile, its kv head's k and v tiles
        return [(j - 1, tile) for tile in qkv_tiles(cfg, pr.p)]
    if name == "w_down":  # gate and up of its channels, interleaved by 128
        return [(j - 1, 2 * lax.div(k_at, BLOCK_N) + i) for i in range(2 * BLOCK_K // BLOCK_N)]
    return [(j - 1, lax.div(k_at, BLOCK_N) + i) for i in range(BLOCK_K // BLOCK_N)]


def _wait_inputs(pr: Program, layer, j, u):
    """Until every piece of the tiles holding unit u's inputs is counted (once a tile: a run's first sight of it)."""
    ph = pr.config.phases[j]
    begin = pr.runs[j][0]
    k_at = pr.k_of(j, u)
    first_sight = (u - begin < ph.steps) if ph.stream_k else (u == begin)

    @pl.when(first_sight & (layer > 0) if j == 0 else first_sight)
    def _():
        src_layer = layer - 1 if j == 0 else layer
        for s, n in [pr.count_of(src_layer, src_j, tile) for src_j, tile in _sources(pr, j, k_at)]:
            plgpu.semaphore_wait(s, n, decrement=False, memory_scope="gpu")


def _inputs_of(pr: Program, layer, j, u):
    """(phase, layer, first column, columns) of the sums phase j's unit u reads: the phase before's (qkv: the layer
    before's down; layer 0 reads the last layer's, which qkv's own copy replaces by x0)."""
    ph, last = pr.config.phases[j], len(pr.config.phases) - 1
    k_at = pr.k_of(j, u)
    src_j = j - 1 if j else last
    src_layer = layer if j else jnp.where(layer > 0, layer - 1, pr.config.layers - 1)
    width = 2 * BLOCK_K if ph.name == "w_down" else BLOCK_K  # down: its inputs' gate and up sums
    col = 2 * k_at if ph.name == "w_down" else (qkv_tiles(pr.config.model, pr.p)[0] * BLOCK_N if not ph.stream_k
                                                else k_at)
    return src_j, src_layer, col, width


def _copy_attention_inputs(pr: Program, layer, j, slot, src_j, src_layer, col):
    """A head's q sums and each row's cos | sin on stage_bar; its kv head's k and v sums beside them and the layer
    input's squares on att_bar."""
    refs, s, hd = pr.refs, pr.scratch, pr.config.model.head_dim
    plgpu.copy_gmem_to_smem(refs.sums[src_j].at[src_layer, pl.ds(0, BATCH), pl.ds(col, hd)],
                            s.xs_smem.at[slot, pl.ds(0, BATCH), pl.ds(0, hd)], s.stage_bar.at[slot])
    plgpu.copy_gmem_to_smem(refs.cos_sin.at[pl.ds(0, BATCH)], s.xs_smem.at[slot, pl.ds(0, BATCH), pl.ds(BLOCK_K, hd)],
                            s.stage_bar.at[slot])
    for at, tile in zip((hd, BLOCK_K + hd), qkv_tiles(pr.config.model, pr.p)[1:]):
        plgpu.copy_gmem_to_smem(refs.sums[src_j].at[src_layer, pl.ds(0, BATCH), pl.ds(tile * BLOCK_N, hd)],
                                s.xs_smem.at[slot, pl.ds(0, BATCH), pl.ds(at, hd)], s.att_bar)
    plgpu.semaphore_wait(pr.squared.at[layer], pr.epoch * pr.holders, decrement=False, memory_scope="gpu")
    plgpu.copy_gmem_to_smem(refs.squares.at[layer, pl.ds(0, s.rs_smem.shape[0])], s.rs_smem, s.att_bar)


def _copy_activations(pr: Program, layer, j, u):
    """Unit u's sums (and a normed product's gains) into its slot's staging, once its inputs are done."""
    ph, s = pr.config.phases[j], pr.scratch
    _wait_inputs(pr, layer, j, u)
    _, slot = pr.position(layer, j, u)
    src_j, src_layer, col, width = _inputs_of(pr, layer, j, u)
    if ph.name == "attn":  # once a head
        pl.when(u == pr.runs[j][0])(lambda: _copy_attention_inputs(pr, layer, j, slot, src_j, src_layer, col))
        return

    def stage(at, w):  # sums [BATCH, w] from column col + at into the staging's columns at
        dst = s.xs_smem.at[slot, pl.ds(0, BATCH), pl.ds(at, w)]
        if j == 0:  # qkv reads the layer's input
            return pr.copy_layer_input(layer, pl.ds(col + at, w), dst, s.stage_bar.at[slot])
        plgpu.copy_gmem_to_smem(pr.refs.sums[src_j].at[src_layer, pl.ds(0, BATCH), pl.ds(col + at, w)], dst,
                                s.stage_bar.at[slot])

    if ph.name in NORMED:  # the sums, and the gain beside
        stage(0, width)
        plgpu.copy_gmem_to_smem(pr.refs.gains.at[layer, NORMED.index(ph.name), pl.ds(pr.k_of(j, u), BLOCK_K)],
                                s.g_smem.at[slot], s.stage_bar.at[slot])
        return
    for half in range(2):  # (a copy moves at most 256 along a dimension)
        stage(half * width // 2, width // 2)


def _copy_weight(pr: Program, layer, j, u):
    """Unit u's weight tile into its slot, once the slot is free: a product's [128, 256] tile, 32 KB of contiguous
    bytes in stack_layers' layout; attention's K or V block of 128 positions, a page at a time on kv_bar."""
    c, s, ph = pr.config, pr.scratch, pr.config.phases[j]
    g, slot = pr.position(layer, j, u)
    if not ph.stream_k:  # the pages' table entries read before the slot's wait, not after it, off attention's path
        blk, is_k = lax.div(u - pr.runs[j][0], 2), lax.rem(u - pr.runs[j][0], 2) == 0
        base = lax.div(pr.p, c.group) * c.pool + layer * c.model.num_kv_heads * c.pool
        per_block = BLOCK_N // c.page_size
        table = pr.refs.table
        firsts = [(base + jnp.clip(table[jnp.minimum(blk * per_block + i, table.shape[0] - 1)], 0, c.pool - 1))
                  * c.page_size for i in range(per_block)]  # (past the length: any page)

    @pl.when(g >= STAGES)
    def _():
        plgpu.barrier_wait(s.free_bar.at[slot])

    if ph.stream_k:
        tile = layer * (ph.n // BLOCK_N) + lax.div(u, ph.steps)
        step = lax.rem(u, ph.steps)
        src = pr.refs.weights[ph.name].at[pl.ds((tile * (ph.k // BLOCK_K) + step) * BLOCK_N, BLOCK_N)]
        plgpu.copy_gmem_to_smem(src, pr.w_smem.at[slot], s.tile_bar.at[slot])
        return

    def copy_pages(pages, view):  # tile_bar's arrivals are this one and the converter's
        for i, first in enumerate(firsts):
            plgpu.copy_gmem_to_smem(pages.at[pl.ds(first, c.page_size)],
                                    view.at[slot, pl.ds(i * c.page_size, c.page_size)], s.kv_bar.at[slot])

    pl.when(is_k)(lambda: copy_pages(pr.refs.k_pages, pr.k_view))
    pl.when(~is_k)(lambda: copy_pages(pr.refs.v_pages, pr.v_view))
    plgpu.barrier_arrive(s.tile_bar.at[slot])


def producer(pr: Program) -> None:
    """Warpgroup 2: the weights of each run's first STAGES units go out before its activations, whose copies wait
    on the phase before; then a unit's weights and activations together, and the next run's first weights."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    phases = pr.config.phases

    def ahead_of(j):  # the units of phase j whose weights went out before its first activations
        begin, end = pr.runs[j]
        return jnp.minimum(begin + STAGES, end)

    def issue_ahead(layer, j):
        lax.fori_loop(pr.runs[j][0], ahead_of(j), lambda u, c: (_copy_weight(pr, layer, j, u), c)[1], None)

    issue_ahead(0, 0)

    def layer_body(layer, carry):
        for j in range(len(phases)):
            begin, end = pr.runs[j]
            lax.fori_loop(begin, ahead_of(j), lambda u, c, j=j: (_copy_activations(pr, layer, j, u), c)[1], None)

            def step(u, c, j=j):
                _copy_weight(pr, layer, j, u)
                _copy_activations(pr, layer, j, u)
                return c

            lax.fori_loop(ahead_of(j), end, step, None)
            if j + 1 < len(phases):
                issue_ahead(layer, j + 1)
            else:
                pl.when(layer + 1 < pr.config.layers)(lambda: issue_ahead(layer + 1, 0))
        return carry

    lax.fori_loop(0, pr.config.layers, layer_body, None)
    total = pr.config.layers * pr.per_layer
    qmm_gpu.drain(pr.scratch.free_bar, STAGES, jnp.maximum(total - STAGES, 0), total)
