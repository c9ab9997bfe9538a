"""The megakernel's compute warpgroups (0 and 1, 64 output rows of a tile each): the products of the program's runs,
a piece of a tile at a time (parts.ring_product_parts), scaled, plus the residual stream, reduce-added into the
phase's sums and counted; and attention (attention.py) for the program's head."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel.attention import attend
from pallas_kernels.decode_megakernel.parts import ring_product_parts
from pallas_kernels.decode_megakernel.plan import BATCH, BLOCK_N, COMPUTE_REGISTERS, ORDER, STAGES
from pallas_kernels.decode_megakernel.program import Program, load_t
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu


def _zero_outputs(pr: Program) -> None:
    """Warpgroup 0: this program's share of every reduce-added output (the products' sums, the layers' squares)
    zeroed, then counted on `zeroed`."""
    s, c, rows = pr.scratch, pr.config, qmm_gpu.ROWS
    s.z_smem[...] = plgpu.layout_cast(jnp.zeros(s.z_smem.shape, jnp.float32),  # (made here: an input of zeros was a
                                      plgpu.Layout.WG_STRIDED(s.z_smem.shape, vec_size=4))  # launch a step to fill)
    plgpu.commit_smem()  # visible to the copies below
    for j, ph in enumerate(c.phases):
        if not ph.stream_k:
            continue
        chunks = c.layers * (ph.n // rows)

        def zero(i, carry, j=j, n=ph.n):
            chunk = pr.p + i * c.programs
            col = pl.ds(lax.rem(chunk, n // rows) * rows, rows)
            plgpu.copy_smem_to_gmem(s.z_smem.at[pl.ds(0, BATCH)],
                                    pr.refs.sums[j].at[lax.div(chunk, n // rows), pl.ds(0, BATCH), col])
            return carry

        lax.fori_loop(0, lax.div(chunks - pr.p + c.programs - 1, c.programs), zero, None)

    def zero_squares(i, carry):  # layer p, p + programs, ...
        for at in range(0, pr.refs.squares.shape[1], rows):
            plgpu.copy_smem_to_gmem(s.z_smem.at[0], pr.refs.squares.at[pr.p + i * c.programs, pl.ds(at, rows)])
        return carry

    lax.fori_loop(0, lax.div(c.layers - pr.p + c.programs - 1, c.programs), zero_squares, None)
    plgpu.wait_smem_to_gmem(0)
    plgpu.semaphore_signal(pr.zeroed, 1, memory_scope="gpu")


def _fragment(pr: Program, wg_rows, layer, j, tile, begin, end, g0) -> None:
    """This warpgroup's 64 rows of tile `tile` of phase j over the units of the program's run that fall in it,
    reduce-added into the phase's sums and counted. The piece holding the tile's first input step adds the residual
    stream (wo: the layer's input; down: wo's sums, h1), so that wo's sums are h1 and down's h2, as the model's."""
    s, ph, rows, wg = pr.scratch, pr.config.phases[j], qmm_gpu.ROWS, pr.wg
    last = len(pr.config.phases) - 1
    start = jnp.maximum(begin, tile * ph.steps)
    stop = jnp.minimum(end, (tile + 1) * ph.steps)
    col0 = tile * BLOCK_N + wg * rows  # this warpgroup's 64 outputs
    cols = pl.ds(col0, rows)
    # the rows' scales, copied in while the products run
    plgpu.copy_gmem_to_smem(pr.refs.scales[ph.name].at[pl.ds(layer * ph.n + col0, rows)], s.sc_smem.at[wg],
                            s.sc_bar.at[wg])
    residual = ph.name in ("wo", "w_down")
    first_piece = start == tile * ph.steps
    if residual:
        @pl.when(first_piece)
        def _():
            dst = s.res_smem.at[wg, pl.ds(0, BATCH)]
            if ph.name == "w_down":  # (this program's first gate_up units waited for every wo tile)
                src = pr.refs.sums[ORDER.index("wo")].at[layer, pl.ds(0, BATCH), cols]
                return plgpu.copy_gmem_to_smem(src, dst, s.res_bar.at[wg])
            # past layer 0: the layer before's down tile, once all its pieces are in (a program outside attention
            # has waited only for its qkv units' input tiles)
            pl.when(layer > 0)(lambda: plgpu.semaphore_wait(*pr.count_of(layer - 1, last, tile), decrement=False,
                                                            memory_scope="gpu"))
            pr.copy_layer_input(layer, cols, dst, s.res_bar.at[wg])

    acc = ring_product_parts(pr.w_smem, s.x_smem, s.e_smem, s.tile_bar, s.free_bar, wg_rows, start, stop,
                             lambda u: lax.rem(g0 + u - begin, STAGES))
    acc = acc.astype(jnp.float32)
    plgpu.barrier_wait(s.sc_bar.at[wg])
    scale = backend_lib.gpu_load(s.sc_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
    if residual:
        def add_residual(a):
            plgpu.barrier_wait(s.res_bar.at[wg])
            return a + load_t(s.res_smem.at[wg])

        acc = lax.cond(first_piece, add_residual, lambda a: a, acc)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    qmm_gpu.store_transposed(acc, s.o_smem.at[wg], interpreted=False)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.o_smem.at[wg, pl.ds(0, BATCH)], pr.refs.sums[j].at[layer, pl.ds(0, BATCH), cols],
                            reduction_op="add")
    plgpu.wait_smem_to_gmem(0)  # the piece is in global memory before it is counted
    pr.signal_done(layer, j, tile)


def compute(pr: Program) -> None:
    """Warpgroups 0 and 1: once every program's zeros are in, each layer's runs in ORDER; then departed, and program
    0 counts the call once every compute warpgroup has (see program.py)."""
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    c = pr.config
    wg_rows = pl.ds(pl.multiple_of(pr.wg * qmm_gpu.ROWS, qmm_gpu.ROWS), qmm_gpu.ROWS)  # this warpgroup's weight rows
    pl.when(pr.wg == 0)(lambda: _zero_outputs(pr))
    plgpu.semaphore_wait(pr.zeroed, pr.epoch * c.programs, decrement=False, memory_scope="gpu")

    def layer_body(layer, carry):
        for j, ph in enumerate(c.phases):
            begin, end = pr.runs[j]
            g0 = layer * pr.per_layer + pr.bases[j]
            if not ph.stream_k:
                pl.when(begin < end)(functools.partial(attend, pr, layer, j, begin, g0))
                continue
            first_tile = lax.div(begin, ph.steps)
            for f in range(ph.fragments):
                tile = first_tile + f
                pl.when((begin < end) & (tile <= lax.div(end - 1, ph.steps)))(
                    functools.partial(_fragment, pr, wg_rows, layer, j, tile, begin, end, g0))
        return carry

    lax.fori_loop(0, c.layers, layer_body, None)
    plgpu.semaphore_signal(pr.departed, 1, memory_scope="gpu")

    @pl.when((pr.p == 0) & (pr.wg == 0))
    def _():
        plgpu.semaphore_wait(pr.departed, 2 * c.programs, memory_scope="gpu")
        plgpu.semaphore_signal(pr.calls, 1, memory_scope="gpu")
