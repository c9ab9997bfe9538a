"""One program's view of a megakernel call, shared by its warpgroups' roles (producer.py, converter.py, compute.py):
the kernel's refs by name, where this program's run of each phase lies in its ring, and the counts every role
waits on.

The counts are never taken back (taking back each tile's count one atomic at a time, by one program at the end, cost
~130 us a layer): call c waits for (c + 1) times a tile's pieces. `calls` counts the calls; every warpgroup reads it
at its start, and program 0 adds one only once every compute warpgroup has departed (which each does after its
producer's last wait), so no read sees the next call's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel.parts import PART_INPUTS, PARTS, unit_columns
from pallas_kernels.decode_megakernel.plan import (
    BATCH,
    BLOCK_K,
    BLOCK_N,
    COLS,
    INT8_SWIZZLE,
    ORDER,
    P_SWIZZLE,
    PRODUCTS,
    STAGES,
    Config,
)
from pallas_kernels.flash_attention.mosaic_gpu import mma_transforms
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu


class Refs(NamedTuple):
    """The kernel's operands, in the order it takes them (Refs.of)."""
    weights: dict[str, Any]  # PRODUCTS -> stack_layers' tiles as rows [layers · tiles · steps · 128, 256] int8
    k_pages: Any  # [layers · kv heads · pool · page_size, head_dim] bfloat16 (stack_pages), the new K written in place
    v_pages: Any  # and V
    gains: Any  # [layers, 2, d] float32: the attention norm's and the MLP norm's gains
    scales: dict[str, Any]  # PRODUCTS -> [layers · n] float32, a scale an output channel
    cos_sin: Any  # [COLS, head_dim] float32: the new position's rotary cos | sin
    x0: Any  # [COLS, d] float32: the new token, embedded (row 0)
    table: Any  # [pages] int32: the sequence's page table
    length: Any  # [1] int32: the positions cached (the new token's is next)
    sums: tuple[Any, ...]  # outputs: each phase's float32 [layers, COLS, n] (ORDER); wo's are h1, down's h2
    squares: Any  # output: [layers, 128] float32, each row's sum of squares of the layer's input

    @classmethod
    def of(cls, refs) -> Refs:
        at = iter(refs)

        def take(n):
            return [next(at) for _ in range(n)]

        weights = dict(zip(PRODUCTS, take(len(PRODUCTS))))
        k_pages, v_pages, gains = take(3)
        scales = dict(zip(PRODUCTS, take(len(PRODUCTS))))
        cos_sin, x0, table, length = take(4)
        sums, (squares,) = tuple(take(len(ORDER))), take(1)
        return cls(weights, k_pages, v_pages, gains, scales, cos_sin, x0, table, length, sums, squares)


class Scratch(NamedTuple):
    """The kernel's shared memory and barriers, allocated in this order (Scratch.types). A ring slot holds one unit."""
    ring: Any  # [STAGES] slots of an int8 weight tile [128, 256], or (attention) bf16 K and V blocks [128, hd]
    x_smem: Any  # [STAGES, PARTS · COLS, BLOCK_K] int8: a unit's activations in int8 parts
    o_smem: Any  # [2, COLS, 64] float32: each compute warpgroup's piece of a tile, on its way out
    z_smem: Any  # [COLS, 64] float32 zeros: copied over this program's share of the reduce-added outputs
    tile_bar: Any  # [STAGES] a unit's weights (or K/V block) and its activations are in
    free_bar: Any  # [STAGES] both compute warpgroups are done with a slot
    xs_smem: Any  # [STAGES, COLS, 2 · BLOCK_K] float32: the sums a unit's activations are made of, staged
    stage_bar: Any  # [STAGES] a unit's sums staged (two copies)
    e_smem: Any  # [STAGES, BLOCK_K / 128, 32] float32: the units of a slot's int8 parts
    raw_smem: Any  # [COLS, BLOCK_K] float32: down's activations, SiLU(gate)·up, before their split
    g_smem: Any  # [STAGES, BLOCK_K] float32: a normed unit's gains
    sq_smem: Any  # [4, 128] float32: each row's sum of squares: the MLP's by layer parity, an unread row, qkv's
    sc_smem: Any  # [2, 64] float32: each compute warpgroup's rows' scales
    sc_bar: Any  # [2]
    q_smem: Any  # [16, hd] bfloat16: the head's q, rotated and normed
    p_smem: Any  # [BLOCK_N, 16] bfloat16: a K/V block's P
    ao_smem: Any  # [16, hd] float32: the head's output
    res_smem: Any  # [2, COLS, 64] float32: each compute warpgroup's residual
    res_bar: Any  # [2]
    att_bar: Any  # attention's k and v sums and the layer's squares
    rs_smem: Any  # [32] float32: the layer's squares, a number a row
    knew_smem: Any  # [COLS, hd] bfloat16: the new token's k
    vnew_smem: Any  # and v
    fold_smem: Any  # [3, 16, hd] float32: q, k and v for the new token's fold
    kv_bar: Any  # [STAGES] a K/V block's pages, an arrival a page
    fold_bar: Any  # the new token's k, v and q stored for the fold

    @classmethod
    def types(cls, config: Config) -> Scratch:
        hd = config.model.head_dim
        f32 = jnp.float32
        return cls(
            ring=plgpu.RefUnion(  # the same slots as bfloat16 K (128-byte swizzle) and V (32-byte swizzle, as P's)
                plgpu.SMEM((STAGES, BLOCK_N, BLOCK_K), jnp.int8, transforms=INT8_SWIZZLE),
                plgpu.SMEM((STAGES, BLOCK_N, hd), jnp.bfloat16, transforms=mma_transforms(jnp.bfloat16)),
                plgpu.SMEM((STAGES, BLOCK_N, hd), jnp.bfloat16, transforms=P_SWIZZLE)),
            x_smem=plgpu.SMEM((STAGES, PARTS * COLS, BLOCK_K), jnp.int8, transforms=INT8_SWIZZLE),
            o_smem=plgpu.SMEM((2, COLS, qmm_gpu.ROWS), f32),
            z_smem=plgpu.SMEM((COLS, qmm_gpu.ROWS), f32),
            tile_bar=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            free_bar=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            xs_smem=plgpu.SMEM((STAGES, COLS, 2 * BLOCK_K), f32),
            stage_bar=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            e_smem=plgpu.SMEM((STAGES, BLOCK_K // PART_INPUTS, unit_columns(COLS)), f32),
            raw_smem=plgpu.SMEM((COLS, BLOCK_K), f32),
            g_smem=plgpu.SMEM((STAGES, BLOCK_K), f32),
            sq_smem=plgpu.SMEM((4, 128), f32),
            sc_smem=plgpu.SMEM((2, qmm_gpu.ROWS), f32),
            sc_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2),
            q_smem=plgpu.SMEM((16, hd), jnp.bfloat16, transforms=mma_transforms(jnp.bfloat16)),
            p_smem=plgpu.SMEM((BLOCK_N, 16), jnp.bfloat16, transforms=P_SWIZZLE),
            ao_smem=plgpu.SMEM((16, hd), f32),
            res_smem=plgpu.SMEM((2, COLS, qmm_gpu.ROWS), f32),
            res_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2),
            att_bar=plgpu.Barrier(num_arrivals=3),
            rs_smem=plgpu.SMEM((32,), f32),
            knew_smem=plgpu.SMEM((COLS, hd), jnp.bfloat16),
            vnew_smem=plgpu.SMEM((COLS, hd), jnp.bfloat16),
            fold_smem=plgpu.SMEM((3, 16, hd), f32),
            kv_bar=plgpu.Barrier(num_arrivals=max(1, BLOCK_N // config.page_size), num_barriers=STAGES),
            fold_bar=plgpu.Barrier(num_arrivals=1),
        )


def load_t(ref) -> jax.Array:
    """A [rows, 64] tile in shared memory -> [64, rows] float32 in the WGMMA layout."""
    v = backend_lib.gpu_load(ref.transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)
    return plgpu.layout_cast(v.astype(jnp.float32), plgpu.Layout.WGMMA)


class Program:
    """Program `p`'s part of a call, as its warpgroup `wg` sees it. Its run of phase j is units runs[j] = [begin, end)
    (stream-K: its share of the phase's units; attention: head p's K and V blocks, K, V, K, V, ...), which take ring
    steps from bases[j] on in each layer; its ring step g is slot g mod STAGES."""

    def __init__(self, config: Config, refs: Refs, scratch: Scratch):
        self.config, self.refs, self.scratch = config, refs, scratch
        self.w_smem, self.k_view, self.v_view = scratch.ring  # (views of the same slots)
        self.p, self.wg = lax.axis_index("p"), lax.axis_index("wg")
        self.done = pl.get_global(plgpu.SemaphoreType.REGULAR((config.layers * config.per_layer_tiles,)))  # a tile's
        # pieces, counted
        self.zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR(()))  # programs whose outputs' zeros are in
        self.departed = pl.get_global(plgpu.SemaphoreType.REGULAR(()))  # compute warpgroups done with the call
        self.calls = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        # a layer's qkv squares reduce-added by each program holding a unit of qkv's tile 0 (which are every input
        # step once), counted here
        self.squared = pl.get_global(plgpu.SemaphoreType.REGULAR((config.layers,)))
        self.epoch = pl.semaphore_read(self.calls) + 1
        self.length = refs.length[0]  # the positions in the cache (the new token's is next; at least 1, or attention
        # would count no tile and wo would wait on)
        self.blocks = lax.div(self.length + BLOCK_N - 1, BLOCK_N)  # K (and V) blocks of 128 positions a head reads
        self.att_units = 2 * self.blocks
        self.runs = [self._run_of(ph) for ph in config.phases]
        self.holders = lax.div(self.pieces(0, 0), 2)  # programs holding a unit of qkv's tile 0
        self.bases, base = [], 0
        for begin, end in self.runs:
            self.bases.append(base)
            base = base + end - begin
        self.per_layer = base  # ring steps of one layer, for this program

    def _run_of(self, ph):
        programs = self.config.programs
        if ph.stream_k:
            return lax.div(self.p * ph.units, programs), lax.div((self.p + 1) * ph.units, programs)
        return jnp.minimum(self.p, ph.tiles) * self.att_units, jnp.minimum(self.p + 1, ph.tiles) * self.att_units

    def pieces(self, j, tile):
        """The signals that complete a tile of phase j: two warpgroups a program holding a piece of it."""
        ph, programs = self.config.phases[j], self.config.programs
        if not ph.stream_k:
            return 2
        t = jnp.clip(tile, 0, ph.tiles - 1)
        first = qmm_gpu.stream_k_holder(t * ph.steps + 1, ph.units, programs)
        held = qmm_gpu.stream_k_holder((t + 1) * ph.steps, ph.units, programs) - first + 1
        if ph.units <= programs:  # a unit a program at most, and some programs none (the range would count them)
            held = ph.steps
        return jnp.where((tile >= 0) & (tile < ph.tiles), 2 * held, 0)

    def count_of(self, src_layer, src_j, tile):
        """(semaphore, count this call waits for) of a tile's pieces."""
        at = src_layer * self.config.per_layer_tiles + self.config.offsets[src_j] + tile
        return self.done.at[at], self.epoch * self.pieces(src_j, tile)

    def signal_done(self, layer, j, tile):
        """Counts a piece of phase j's tile, once it is in global memory."""
        plgpu.semaphore_signal(self.done.at[layer * self.config.per_layer_tiles + self.config.offsets[j] + tile], 1,
                               memory_scope="gpu")

    def position(self, layer, j, u):
        """(ring step, slot) of phase j's unit u."""
        g = layer * self.per_layer + self.bases[j] + u - self.runs[j][0]
        return g, lax.rem(g, STAGES)

    def k_of(self, j, u):
        """The first input of phase j's unit u."""
        ph = self.config.phases[j]
        return lax.rem(u, ph.steps) * BLOCK_K if ph.stream_k else 0

    def copy_layer_input(self, layer, cols, dst, barrier):
        """The layer's input [BATCH, cols] into dst: the step's x0 for layer 0, the layer before's down sums (h2)."""
        x0, sums = self.refs.x0, self.refs.sums[-1]
        pl.when(layer == 0)(lambda: plgpu.copy_gmem_to_smem(x0.at[pl.ds(0, BATCH), cols], dst, barrier))
        below = sums.at[jnp.maximum(layer - 1, 0), pl.ds(0, BATCH), cols]
        pl.when(layer > 0)(lambda: plgpu.copy_gmem_to_smem(below, dst, barrier))
