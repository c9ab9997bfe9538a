"""The megakernel's converter warpgroup: a unit's staged float32 sums -> the activations the compute warpgroups
multiply, as int8 parts (parts.split_tile) for int8 x int8 wgmma. qkv's and gate_up's inputs are multiplied by their
norm's gain as they are split, and their squares summed for the norm's 1/rms, which multiplies the products' outputs
instead (qkv's: attention's q, k and v; gate_up's: down's gate and up). For attention it makes the head's q, k and v
(normed, rotated, in bfloat16) and writes the new token's K and V into its page."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel.parts import split_tile
from pallas_kernels.decode_megakernel.plan import (
    BATCH,
    BLOCK_K,
    BLOCK_N,
    COLS,
    CONVERTER_REGISTERS,
    LAUNCH_REGISTERS,
    NORMED,
    STAGES,
)
from pallas_kernels.decode_megakernel.program import Program, load_t
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu


def _inverse_rms(pr: Program, squares_ref, shape):
    """1/rms of each row (a number a row, from its sum of squares in squares_ref), broadcast to shape [.., COLS]."""
    sq = backend_lib.gpu_load(squares_ref, layout=plgpu.Layout.WGMMA.reduce(0))
    eps = pr.config.model.rms_norm_eps
    return lax.broadcast_in_dim(lax.rsqrt(sq * (1.0 / pr.config.model.hidden_size) + eps), shape, [1])


def _make_qkv(pr: Program, slot):
    """The head's q, k and v from the staged sums: times the attention norm's 1/rms, q and k rotated, rounded to
    bfloat16 (the cache's values). q is published first, alone: attention's first block waits for it; k and v (for
    the page write) and q, k, v in float32 (for the fold) follow."""
    s, hd = pr.scratch, pr.config.model.head_dim
    plgpu.barrier_wait(s.stage_bar.at[slot])
    half = hd // 2

    def staged(at):
        return load_t(s.xs_smem.at[slot, :, pl.ds(at, half)])
    lo, hi = staged(0), staged(half)
    cos, sin = staged(BLOCK_K), staged(BLOCK_K + half)

    def rotated(lo, hi):
        return lo * cos - hi * sin, hi * cos + lo * sin

    plgpu.barrier_wait(s.att_bar)
    inv = _inverse_rms(pr, s.rs_smem.at[pl.ds(0, COLS)], lo.shape)

    def bf16(halves):  # bfloat16's values (the cache's), in float32
        return [a.astype(jnp.bfloat16).astype(jnp.float32) for a in halves]
    q = bf16(rotated(lo * inv, hi * inv))
    k = bf16(rotated(staged(hd) * inv, staged(hd + half) * inv))
    v = bf16((staged(BLOCK_K + hd) * inv, staged(BLOCK_K + hd + half) * inv))
    # (wg0 sums the fold's q·k: a sum across this warpgroup's warps here never finished)
    later = [(s.knew_smem, k), (s.vnew_smem, v), *((s.fold_smem.at[i, pl.ds(0, COLS)], a) for i, a in enumerate((q, k, v)))]

    def store(made):
        for ref, halves in made:
            for at, val in zip((0, half), halves):
                qmm_gpu.store_transposed(val, ref.at[:, pl.ds(at, half)], interpreted=False)
        plgpu.commit_smem()
    store([(s.q_smem.at[pl.ds(0, COLS)], q)])
    plgpu.barrier_arrive(s.tile_bar.at[slot])
    store(later)  # (publishing q with these made every block wait for them)
    plgpu.barrier_arrive(s.fold_bar)  # wg0's fold waits for it after the cached blocks


def _write_new_token(pr: Program, layer):
    """The new token's K and V into the next position of the sequence's pages."""
    c, table = pr.config, pr.refs.table
    entry = jnp.minimum(lax.div(pr.length, c.page_size), table.shape[0] - 1)
    page = jnp.clip(table[entry], 0, c.pool - 1)
    row = ((layer * c.model.num_kv_heads + lax.div(pr.p, c.group)) * c.pool + page) * c.page_size + lax.rem(
        pr.length, c.page_size)
    for src, pages in ((pr.scratch.knew_smem, pr.refs.k_pages), (pr.scratch.vnew_smem, pr.refs.v_pages)):
        plgpu.copy_smem_to_gmem(src.at[pl.ds(0, 1)], pages.at[pl.ds(row, 1)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (all awaited at the end)


def _attention_unit(pr: Program, layer, j, u, slot):
    """A head's first unit: its q, k and v made; every unit: handed to the compute warpgroups. After its last, the
    group's first head writes the new token's K and V (writing at the first, before the rest's, was slower)."""
    begin, end = pr.runs[j]
    pl.when(u == begin)(lambda: _make_qkv(pr, slot))
    pl.when(u != begin)(lambda: plgpu.barrier_arrive(pr.scratch.tile_bar.at[slot]))
    pl.when((u == end - 1) & (lax.rem(pr.p, pr.config.group) == 0))(lambda: _write_new_token(pr, layer))


def _zero_squares(pr: Program, layer):
    """A layer's first unit: its MLP's and its qkv's sums of squares start from zero."""
    zeros = plgpu.layout_cast(jnp.zeros((128,), jnp.float32), plgpu.Layout.WG_STRIDED((128,), vec_size=1))
    pr.scratch.sq_smem.at[lax.rem(layer, 2)][...] = zeros
    pr.scratch.sq_smem.at[3][...] = zeros
    plgpu.commit_smem()  # (a warpgroup barrier: zero before this unit's split adds)


def _publish_squares(pr: Program, layer):
    """This program's squares of qkv's tile 0 into the layer's, counted."""
    plgpu.copy_smem_to_gmem(pr.scratch.sq_smem.at[3], pr.refs.squares.at[layer], reduction_op="add")
    plgpu.wait_smem_to_gmem(0)
    plgpu.semaphore_signal(pr.squared.at[layer], 1, memory_scope="gpu")


def _split_unit(pr: Program, layer, j, u, slot):
    """qkv's, wo's and gate_up's staged sums are their activations: split in place (qkv's and gate_up's times their
    gains, their squares summed)."""
    s, phases = pr.scratch, pr.config.phases
    name, begin = phases[j].name, pr.runs[j][0]
    if j == 0:
        pl.when(u == begin)(lambda: _zero_squares(pr, layer))
    gain: dict[str, Any] = {}
    if name in NORMED:
        # qkv's tile 0 holds each input step once: its squares are the row's (3). gate_up: the first `steps` units
        # of a run hold each input step once (a run is longer), so their squares make the row's whole sum (by layer
        # parity); any other unit's go to an unread row (2)
        row = (jnp.where(u < phases[0].steps, 3, 2) if j == 0
               else jnp.where(u - begin < phases[j].steps, lax.rem(layer, 2), 2))
        gain = {"gain": s.g_smem.at[slot], "squares": s.sq_smem.at[row]}
    split_tile(s.xs_smem.at[slot], s.x_smem.at[slot], s.e_smem.at[slot], rows=BATCH, **gain)
    plgpu.commit_smem()  # visible to the tensor cores before the compute warpgroups hear of it
    plgpu.barrier_arrive(s.tile_bar.at[slot])
    if j == 0:
        pl.when(u == jnp.minimum(pr.runs[0][1], phases[0].steps) - 1)(lambda: _publish_squares(pr, layer))


def _down_unit(pr: Program, layer, slot):
    """down's activations, SiLU(gate)·up from gate_up's interleaved sums, each times the MLP norm's 1/rms, then
    split."""
    s = pr.scratch
    for c in range(BLOCK_K // qmm_gpu.ROWS):  # gate and up interleaved by 128 channels
        at = c // 2 * 2 * BLOCK_N + c % 2 * qmm_gpu.ROWS
        gate = load_t(s.xs_smem.at[slot, :, pl.ds(at, qmm_gpu.ROWS)])
        up = load_t(s.xs_smem.at[slot, :, pl.ds(at + BLOCK_N, qmm_gpu.ROWS)])
        inv = _inverse_rms(pr, s.sq_smem.at[lax.rem(layer, 2), pl.ds(0, COLS)], gate.shape)
        gate, up = gate * inv, up * inv
        v = gate / (1.0 + jnp.exp(-gate)) * up
        qmm_gpu.store_transposed(v, s.raw_smem.at[:, pl.ds(c * qmm_gpu.ROWS, qmm_gpu.ROWS)], interpreted=False)
    plgpu.commit_smem()  # (a warpgroup barrier: every thread's activations before the split reads them)
    split_tile(s.raw_smem, s.x_smem.at[slot], s.e_smem.at[slot], rows=BATCH)
    plgpu.commit_smem()  # visible to the tensor cores before the compute warpgroups hear of it
    plgpu.barrier_arrive(s.tile_bar.at[slot])


def converter(pr: Program) -> None:
    """Warpgroup 3: each unit of the program's runs, in ring order, once its slot is free and its sums are staged."""
    plgpu.set_max_registers(CONVERTER_REGISTERS,
                            action="increase" if CONVERTER_REGISTERS > LAUNCH_REGISTERS else "decrease")
    plgpu.semaphore_wait(pr.zeroed, pr.epoch * pr.config.programs, decrement=False,
                         memory_scope="gpu")  # its reduce-adds of squares land after every program's zeroes

    def unit(layer, j, u):
        g, slot = pr.position(layer, j, u)

        @pl.when(g >= STAGES)  # the compute warpgroups are done with the slot's activations
        def _():
            plgpu.barrier_wait(pr.scratch.free_bar.at[slot])

        name = pr.config.phases[j].name
        if name == "attn":
            return _attention_unit(pr, layer, j, u, slot)
        plgpu.barrier_wait(pr.scratch.stage_bar.at[slot])
        if name == "w_down":
            return _down_unit(pr, layer, slot)
        _split_unit(pr, layer, j, u, slot)

    def layer_body(layer, carry):
        for j in range(len(pr.config.phases)):
            lax.fori_loop(pr.runs[j][0], pr.runs[j][1], lambda u, c, j=j: (unit(layer, j, u), c)[1], None)
        return carry

    lax.fori_loop(0, pr.config.layers, layer_body, None)
    plgpu.wait_smem_to_gmem(0)  # the new tokens' K/V writes have landed
