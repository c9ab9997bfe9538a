"""The int8 decode layer past attention as one Mosaic GPU kernel: wo, the residual, the MLP and the next layer's qkv.

A decode step at batch 1 with one kernel per product stays at or below 1.69x bfloat16 on an H100 however little work
a product does on its bytes (benchmarks/int8_gpu_notes.md, session 22): each product's start and end, and the small
XLA kernels between products (residual adds, norms, SiLU·up, conversions: ~10 us a layer), cost as much as a
layer's bytes do. This kernel runs the four products from one layer's attention output to the next layer's qkv
(reference.py says what it computes) with no kernel boundary and no XLA kernel between them.

Phases wo, gate_up, down, qkv run in turn on NUM_SMS programs (fewer for small layers: default_programs), one an
SM, all resident. In each phase program p streams a run of the phase's units (an output tile of 128 rows of the
weight, one step of 256 inputs; runs differ by at most one unit and none is empty) in tile-major order (stream-K,
as quantized_matmul's stream-K kernel) through one copy ring that runs on across phases.
Four warpgroups a program: the producer copies (the weight tile as two halves of 64 rows, and the activations); two
compute warpgroups multiply (64 rows each) and hand each fragment's float32 sums (a fragment: the run's units of
one tile) to the epilogue warpgroup through shared memory, two deep, and go on; the epilogue warpgroup does
everything else, so the products never wait on a store. A run crosses tiles, so a tile is cut into pieces held by
consecutive programs: the piece at the end of the lowest program's run (its owner, done last) is finished once the
producer has gathered the others (they sit at the start of their programs' runs, are long done, and wait in slots
of global memory, each signalled on a grid-shared semaphore of its (tile, half)); they are added in a fixed order
(deterministic). Finishing a tile:

- wo: h1 = h0 + sums (rounded to h0's dtype, as the model rounds its residual), written out; x = h1 · g_mlp in
  float16 (times X_SHIFT, the quantized products' float16 activations) for gate_up; each 64 channels' sum of h1²
  into `ss`.
- gate_up: a tile is 64 gate rows (the first half) and the same channels' 64 up rows, copied from values [f, 2 d];
  silu(gate) · up is written (float16, times X_SHIFT) for down. The norm's 1/rms multiplies the sums (a number per
  row), computed by the epilogue warpgroup from `ss` (below).
- down: h2 = h1 + sums, written out; x = h2 · g_attn for qkv; sums of h2² into `ss`.
- qkv: the sums times the norm's 1/rms, written out.

No barrier ends a phase: a unit waits only for the tiles its inputs come from. An owner, once a tile's outputs are
in global memory, signals the tile's semaphore; the producer waits for it before copying the activations of the
first `steps` units of its run in the next phase (they read every input the run does); so a phase starts while the
last owners of the one before finish. The norm's 1/rms needs every tile's sums of squares, but only in the owners'
epilogues, at the end of a run: the epilogue warpgroup waits there for a count of wo's (down's) finished tiles and
computes it. The semaphores go back to zero once every program is done (leave). Each phase writes its pieces to
slots of its own, since the next phase's pieces may be stored while its last owners still gather.

Only on a GPU: grid-shared semaphores have no interpreter (tests lower it for CUDA on the CPU and run it on the GPU).

Status (H100, JAX 0.11.2, benchmarks/layer_gpu.py, 4 layers of 8B shapes at batch 1, device time): correct (within
7e-3 of the model's path after 4 layers; its GPU tests pass) but still slower than the model's path for the same
math: 105.6-106.2 against 99.5-99.8 us a layer in four runs (with grid barriers between phases: 110.4 against 99.5),
so the model does not call it. Without any waits (a trial, wrong outputs) it takes ~94: the waits cost 5.3, 4.0 and
2.1 us a layer going into gate_up, down and qkv, the latency of a chain of two hops between SMs where a tile's
middle pieces end their programs' runs (benchmarks/int8_gpu_notes.md, session 24). With neither waits nor products
(the ring step a stand-in that only hands tiles back) it still takes ~88: the pieces, owners and epilogues cost ~12
us a layer over a schedule without them, so this structure cannot give the 8B step 1.8x bfloat16 (session 26).
Splitting the producer by warp (weights apart from the waits and the gathers) was slower: 111.4 against 106.4.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.mosaic_gpu import mma_transforms
from pallas_kernels.quantized_layer.reference import LayerWeights
from pallas_kernels.quantized_matmul.mosaic_gpu import (
    ROW_MULTIPLE,
    ROWS,
    X_SHIFT,
    activation_rows,
    drain,
    ring_product,
    store_transposed,
    stream_k_holder,
    stream_k_plan,
)

NUM_SMS = backend_lib.NUM_SMS
BLOCK_N = 2 * ROWS  # weight rows a tile: 64 a compute warpgroup
BLOCK_K = 256  # inputs a step
STAGES = 3
SS_ROWS = 64  # the sums of squares are read as [64, rows] tiles: d must be a multiple of 64 · 64
# registers a thread, by warpgroup (two compute, the producer, the epilogue): 512 in all, the H100's 64K over 512 threads
COMPUTE_REGISTERS, PRODUCER_REGISTERS, EPILOGUE_REGISTERS = 200, 40, 72


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    n: int  # weight rows
    tiles: int
    steps: int  # units a tile
    slots: int  # the most pieces a tile has
    fragments: int  # the most tiles a program's run touches
    out_cols: int  # the columns of its output a tile finishes (the next phase's inputs)

    @property
    def units(self) -> int:
        return self.tiles * self.steps


def plan(d: int, f: int, nq: int, programs: int) -> tuple[Phase, ...]:
    phases = []
    for name, n, k in (("wo", d, d), ("gate_up", 2 * f, d), ("down", d, f), ("qkv", nq, d)):
        tiles, steps = n // BLOCK_N, k // BLOCK_K
        slots, fragments = stream_k_plan(steps, tiles, programs)
        phases.append(Phase(name, n, tiles, steps, slots, fragments, ROWS if name == "gate_up" else BLOCK_N))
    return tuple(phases)


def supports(m: int, d: int, f: int, nq: int) -> bool:
    return (m <= ROW_MULTIPLE and d % (SS_ROWS * ROWS) == 0 and f % BLOCK_K == 0
            and nq % BLOCK_N == 0)


def _load_t(ref) -> jax.Array:
    """A [rows, 64] tile in shared memory -> [64, rows] float32 in the WGMMA layout."""
    v = backend_lib.gpu_load(ref.transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)
    return plgpu.layout_cast(v.astype(jnp.float32), plgpu.Layout.WGMMA)


def _row_vector(ref, shape) -> jax.Array:
    """[64] per-channel numbers in shared memory -> broadcast over `shape` [64, rows] in the WGMMA layout."""
    v = backend_lib.gpu_load(ref, layout=plgpu.Layout.WGMMA.reduce(1)).astype(jnp.float32)
    return lax.broadcast_in_dim(v, shape, [0])


def _kernel(a_ref, h0_ref, wo_ref, wo_s, gm_ref, gu_ref, gu_s, dn_ref, dn_s, ga_ref, q_ref, q_s,
            h2_ref, qkv_ref, h1_ref, xb_ref, act_ref, ss_ref, slot_ref,
            x_smem, w_smem, ep_smem, sq_smem, ob_smem, of_smem, oq_smem, sc_smem, g_smem, res_smem,
            ss_smem, pc_smem, tile_bar, free_bar, ep_ready, ep_free, g_bar, g_free, sc_bar, gr_bar, ss_bar,
            *, phases: tuple[Phase, ...], programs: int, eps: float, trial: str):
    p, wg = lax.axis_index("p"), lax.axis_index("wg")
    stages = x_smem.shape[0]
    d = a_ref.shape[1]
    m = x_smem.shape[1]
    offsets = [sum(ph.tiles for ph in phases[:j]) for j in range(len(phases))]
    row_offsets = [sum(ph.n for ph in phases[:j]) for j in range(len(phases))]
    pieces_done = pl.get_global(plgpu.SemaphoreType.REGULAR((offsets[-1] + phases[-1].tiles, 2)))
    # a tile of every phase but the last, finished (its outputs in global memory): its owner signals 1, the programs
    # that read its outputs wait for it without taking it back (a count taken by many is a contended compare-and-swap
    # loop each: 168.7 against 110.4 us a layer), and the owner takes it back once every program is done (leave)
    ready = pl.get_global(plgpu.SemaphoreType.REGULAR((offsets[-1],)))
    # the phases that add to the residual stream (wo, down) and their places among them (`stream`: their semaphore in
    # `finished`, their output h1 or h2, their sums of squares in ss_ref); a count of each one's finished tiles: the
    # norm's 1/rms after it needs every tile's sums of squares, the next residual phase its output
    stream_phases = [j for j, ph in enumerate(phases) if ph.name in ("wo", "down")]
    stream = {j: i for i, j in enumerate(stream_phases)}
    finished = pl.get_global(plgpu.SemaphoreType.REGULAR((len(stream),)))

    def wait_finished(j):  # every tile of residual phase j
        plgpu.semaphore_wait(finished.at[stream[j]], phases[j].tiles, decrement=False, memory_scope="gpu")
    x_srcs = (a_ref, xb_ref, act_ref, xb_ref)
    trials = set(trial.split(","))

    def waited(j):  # whether phase j's units wait for the tiles of the phase before (trials leave them out)
        return j > 0 and not trials & {"no-wait", f"no-wait-{phases[j].name}"}

    def w_src(j, tile, k_at, half):  # half of phase j's weight tile: 64 rows by a step
        cols = pl.ds(k_at, BLOCK_K)
        if phases[j].name == "gate_up":  # values [f, 2 d]: the tile's channels' gate rows, then their up rows
            return gu_ref.at[pl.ds(tile * ROWS, ROWS), pl.ds(half * d + k_at, BLOCK_K)]
        ref = (wo_ref, None, dn_ref, q_ref)[j]
        return ref.at[pl.ds(tile * BLOCK_N + half * ROWS, ROWS), cols]

    def holders(ph, tile):  # the programs holding the tile's first unit (its owner) and its last
        return (stream_k_holder(tile * ph.steps + 1, ph.units, programs),
                stream_k_holder((tile + 1) * ph.steps, ph.units, programs))

    def slot_rows(j, tile, half):  # a piece's rows in slot_ref (each phase its own: phases overlap)
        return pl.ds(row_offsets[j] + tile * BLOCK_N + half * ROWS, ROWS)

    def each_fragment(body, phases=phases):  # body(j, phase, tile, f) for each fragment of each phase's run (f: its
        # place in the run), in order
        for j, ph in enumerate(phases):
            begin, end = runs[j]
            last_tile = lax.div(end - 1, ph.steps)
            first = lax.div(begin, ph.steps)
            for f in range(ph.fragments):
                tile = first + f
                pl.when((tile <= last_tile) & (begin < end))(functools.partial(body, j, ph, tile, f))

    runs, bases = [], []
    base = jnp.int32(0)
    for ph in phases:
        begin, end = lax.div(p * ph.units, programs), lax.div((p + 1) * ph.units, programs)
        runs.append((begin, end))
        bases.append(base)
        base = base + end - begin
    total_steps = base

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        def unit(j, u):  # (ring position, slot, weight tile, input offset) of phase j's unit u
            g = bases[j] + u - runs[j][0]
            return g, lax.rem(g, stages), lax.div(u, phases[j].steps), lax.rem(u, phases[j].steps) * BLOCK_K

        def copy_weight(j, u):
            g, slot, tile, k_at = unit(j, u)

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(free_bar.at[slot])

            for half in range(2):
                plgpu.copy_gmem_to_smem(w_src(j, tile, k_at, half), w_smem.at[slot, pl.ds(half * ROWS, ROWS)],
                                        tile_bar.at[slot])

        def copy_x(j, u):  # the unit's activations, once the tiles of the phase before that make them are finished
            _, slot, _, k_at = unit(j, u)
            if waited(j):
                per_step = BLOCK_K // phases[j - 1].out_cols

                @pl.when(u - runs[j][0] < phases[j].steps)  # the run's first sight of this step: the run's first
                # `steps` units read every input the run reads
                @jax.named_scope(f"{phases[j].name}_wait")
                def _():
                    for i in range(per_step):
                        tile = lax.div(k_at, phases[j - 1].out_cols) + i
                        plgpu.semaphore_wait(ready.at[offsets[j - 1] + tile], 1, decrement=False,
                                             memory_scope="gpu")

            plgpu.copy_gmem_to_smem(x_srcs[j].at[:, pl.ds(k_at, BLOCK_K)], x_smem.at[slot], tile_bar.at[slot])

        def gather(j):  # the other pieces of the run's last tile, if this program owns it: copied in for the
            # epilogue warpgroup while the compute warpgroups finish their last steps
            begin, end = runs[j]
            tile = lax.div(end - 1, phases[j].steps)
            owner, last = holders(phases[j], tile)

            @pl.when((begin < end) & (p == owner) & (last > owner))
            def _():
                plgpu.barrier_wait(g_free)
                for half in range(2):
                    plgpu.semaphore_wait(pieces_done.at[offsets[j] + tile, half], last - owner, memory_scope="gpu")

                def copy(i, carry):
                    for half in range(2):
                        plgpu.copy_gmem_to_smem(slot_ref.at[i, slot_rows(j, tile, half)], pc_smem.at[i - 1, half],
                                                g_bar.at[i - 1])
                    return carry

                lax.fori_loop(1, last - owner + 1, copy, None)

        def ahead_of(j):  # phase j's units whose weights went out at the end of the phase before
            begin, end = runs[j]
            return jnp.minimum(begin + stages, end) if j else begin

        for j in range(len(phases)):
            begin, end = runs[j]
            lax.fori_loop(begin, ahead_of(j), lambda u, c, j=j: copy_x(j, u), None)

            def step(u, carry, j=j):
                copy_weight(j, u)
                copy_x(j, u)
                return carry

            with jax.named_scope(f"{phases[j].name}_issue"):
                lax.fori_loop(ahead_of(j), end, step, None)
            # first the owner's pieces (the epilogue waits on them; sent first, they arrive while the last steps are
            # computed: measured 118.0 against 122.3 us a layer the other way round), then the next phase's first
            # weight tiles
            with jax.named_scope(f"{phases[j].name}_gather"):
                gather(j)
            if j + 1 < len(phases):
                lax.fori_loop(runs[j + 1][0], ahead_of(j + 1), lambda u, c, j=j: copy_weight(j + 1, u), None)
        drain(free_bar, stages, jnp.maximum(total_steps - stages, 0), total_steps)

    @pl.when(wg < 2)
    def _compute():  # products only: each fragment's sums go to the epilogue warpgroup through shared memory
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        rows = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)

        def fragment(j, ph, tile, f):
            begin, end = runs[j]
            start = jnp.maximum(begin, tile * ph.steps)
            stop = jnp.minimum(end, (tile + 1) * ph.steps)
            with jax.named_scope(f"{ph.name}_product"):
                sums = ring_product(w_smem, x_smem, tile_bar, free_bar, rows, start, stop,
                                    lambda u: lax.rem(bases[j] + u - begin, stages), interpreted=False)
            plgpu.barrier_wait(ep_free.at[f % 2])
            ep_smem.at[f % 2, wg][...] = sums
            plgpu.commit_smem()
            plgpu.barrier_arrive(ep_ready.at[f % 2])

        each_fragment(fragment)

    def leave():  # grid-shared semaphores outlive the call: back to zero, once every program is done with them
        gone, left = (pl.get_global(plgpu.SemaphoreType.REGULAR(())) for _ in range(2))
        plgpu.semaphore_signal(gone, 1, memory_scope="gpu")
        plgpu.semaphore_wait(gone, programs, decrement=False, memory_scope="gpu")

        def take_back(j, ph, tile, f):
            if not waited(j + 1):
                return

            @pl.when(holders(ph, tile)[0] == p)
            def _():
                plgpu.semaphore_signal(ready.at[offsets[j] + tile], -1, memory_scope="gpu")

        each_fragment(take_back, phases[:-1])  # every wait has passed: each owner takes its tiles' signals back
        plgpu.semaphore_signal(left, 1, memory_scope="gpu")

        @pl.when(p == 0)
        def _():
            plgpu.semaphore_wait(left, programs, memory_scope="gpu")  # (one waiter: no contention)
            plgpu.semaphore_signal(gone, -programs, memory_scope="gpu")
            for j, i in stream.items():
                plgpu.semaphore_signal(finished.at[i], -phases[j].tiles, memory_scope="gpu")

    @pl.when(wg == 3)
    def _epilogue():  # the pieces' stores and signals, the owners' epilogues and their tiles' signals
        plgpu.set_max_registers(EPILOGUE_REGISTERS, action="decrease")
        shape = (ROWS, m)
        for slot in range(2):
            plgpu.barrier_arrive(ep_free.at[slot])  # both hand-over buffers start free
        plgpu.barrier_arrive(g_free)  # so does the gathered pieces' buffer

        def row_sums_out(v, buf, ref):  # v [64, m]'s column sums into ref [1, m] in global memory, through buf
            buf[...] = lax.broadcast_in_dim(jnp.sum(v, axis=0), shape, [1])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf.at[pl.ds(0, 1)], ref)

        def store_out(v, buf, ref):  # v [64, m] -> ref [m, 64] in global memory, through buf [m, 64]
            store_transposed(v, buf, interpreted=False)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, ref)

        def fetch(j, ph, tile):  # an owner's per-channel scales, and for wo and down the gain and residual, by half
            for half in range(2):
                cols = pl.ds(tile * BLOCK_N + half * ROWS, ROWS)
                if ph.name == "gate_up":
                    scales = gu_s.at[half, pl.ds(tile * ROWS, ROWS)]
                else:
                    scales = {"wo": wo_s, "down": dn_s, "qkv": q_s}[ph.name].at[cols]
                plgpu.copy_gmem_to_smem(scales, sc_smem.at[half], sc_bar.at[half])
                if j in stream:
                    gain, res = ((gm_ref, h0_ref), (ga_ref, h1_ref))[stream[j]]
                    plgpu.copy_gmem_to_smem(gain.at[cols], g_smem.at[half], gr_bar.at[half])
                    plgpu.copy_gmem_to_smem(res.at[:, cols], res_smem.at[half], gr_bar.at[half])

        def scaled(total, half):
            plgpu.barrier_wait(sc_bar.at[half])
            return total * _row_vector(sc_smem.at[half], shape) * (1 / X_SHIFT)

        def rms(i):  # [64, m]: the norm's 1/rms of each row, from the sums of squares in ss_smem[i]
            total = sum(jnp.sum(plgpu.layout_cast(ss_smem[i, pl.ds(c, SS_ROWS)], plgpu.Layout.WGMMA), axis=0)
                        for c in range(0, ss_smem.shape[1], SS_ROWS))
            return lax.broadcast_in_dim(lax.rsqrt(total / d + eps), shape, [1])

        def finish_residual(tile, totals, out_ref, ss):  # wo and down: h = residual + sums, x = h · gain
            for half in range(2):
                cols = pl.ds(tile * BLOCK_N + half * ROWS, ROWS)
                v = scaled(totals[half], half)
                plgpu.barrier_wait(gr_bar.at[half])
                h = (_load_t(res_smem.at[half]) + v).astype(out_ref.dtype).astype(jnp.float32)
                store_out(h, ob_smem.at[half], out_ref.at[:, cols])
                store_out(h * _row_vector(g_smem.at[half], shape) * X_SHIFT, of_smem.at[half], xb_ref.at[:, cols])
                row_sums_out(h * h, sq_smem.at[half], ss.at[pl.ds(2 * tile + half, 1)])

        def finish(j, ph, tile, totals):
            # every buffer below is written once an epilogue: the stores of the one before must have read theirs
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if j in stream:
                finish_residual(tile, totals, (h1_ref, h2_ref)[stream[j]], ss_ref.at[stream[j]])
            elif ph.name == "gate_up":  # half 0 the tile's gate rows, half 1 the same channels' up rows
                r = rms(stream[j - 1])
                g, u = scaled(totals[0], 0) * r, scaled(totals[1], 1) * r
                store_out(g / (1.0 + jnp.exp(-g)) * u * X_SHIFT, of_smem.at[0], act_ref.at[:, pl.ds(tile * ROWS, ROWS)])
            else:
                r = rms(stream[j - 1])
                for half in range(2):
                    cols = pl.ds(tile * BLOCK_N + half * ROWS, ROWS)
                    store_out(scaled(totals[half], half) * r, oq_smem.at[half], qkv_ref.at[:, cols])

        def fragment(j, ph, tile, f):
            owner, last = holders(ph, tile)
            piece = p - owner

            @pl.when(piece == 0)
            def _():  # the epilogue's inputs, copied while the product runs
                if stream.get(j, 0) > 0:  # its residual is the residual phase before's output, which this program's
                    # units need not have waited for (a gate_up run inside one tile waits for only some wo tiles)
                    wait_finished(stream_phases[stream[j] - 1])
                fetch(j, ph, tile)

            if j - 1 in stream:  # the norm before it needs every tile of the residual phase before
                first_owned = jnp.where(lax.rem(runs[j][0], ph.steps) == 0, 0, 1)

                @pl.when((piece == 0) & (f == first_owned))
                @jax.named_scope(f"{ph.name}_rms")
                def _():
                    wait_finished(j - 1)
                    plgpu.copy_gmem_to_smem(ss_ref.at[stream[j - 1]], ss_smem.at[stream[j - 1]], ss_bar)
                    plgpu.barrier_wait(ss_bar)

            plgpu.barrier_wait(ep_ready.at[f % 2])

            @pl.when(piece > 0)
            @jax.named_scope(f"{ph.name}_piece")
            def _piece():
                for half in range(2):
                    plgpu.copy_smem_to_gmem(ep_smem.at[f % 2, half], slot_ref.at[piece, slot_rows(j, tile, half)])
                plgpu.wait_smem_to_gmem(0)  # in global memory before the owner hears of it
                plgpu.barrier_arrive(ep_free.at[f % 2])
                for half in range(2):
                    plgpu.semaphore_signal(pieces_done.at[offsets[j] + tile, half], 1, memory_scope="gpu")

            @pl.when(piece == 0)
            @jax.named_scope(f"{ph.name}_owner")
            def _owner():  # the other pieces, gathered by the producer (in a fixed order: deterministic)
                own = tuple(plgpu.layout_cast(ep_smem.at[f % 2, half][...], plgpu.Layout.WGMMA)
                            for half in range(2))
                plgpu.barrier_arrive(ep_free.at[f % 2])

                def add(i, totals):
                    plgpu.barrier_wait(g_bar.at[i - 1])
                    return tuple(total + plgpu.layout_cast(pc_smem.at[i - 1, half][...], plgpu.Layout.WGMMA)
                                 for half, total in enumerate(totals))

                totals = lax.fori_loop(1, last - owner + 1, add, own)

                @pl.when(last > owner)
                def _():
                    plgpu.barrier_arrive(g_free)

                if "no-epilogue" not in trials:
                    finish(j, ph, tile, totals)
                else:  # the fetches' barriers are still waited for: each completion is awaited once
                    for half in range(2):
                        plgpu.barrier_wait(sc_bar.at[half])
                        if j in stream:
                            plgpu.barrier_wait(gr_bar.at[half])
                if j + 1 < len(phases):  # the tile's outputs are in global memory: its waiters may copy them
                    plgpu.wait_smem_to_gmem(0)
                    if waited(j + 1):
                        plgpu.semaphore_signal(ready.at[offsets[j] + tile], 1, memory_scope="gpu")
                    if j in stream:
                        plgpu.semaphore_signal(finished.at[stream[j]], 1, memory_scope="gpu")

        each_fragment(fragment)
        plgpu.wait_smem_to_gmem(0)
        leave()


def decode_layer(a: jax.Array, h0: jax.Array, w: LayerWeights, *, eps: float, out_dtype: Any = None,
                 programs: int | None = None, stages: int = STAGES, trial: str = "",
                 compiler_params: Any = None) -> tuple[jax.Array, jax.Array]:
    """See reference.decode_layer: a [m, d] (the attention output, bfloat16 or float16) and the residual h0 [m, d],
    m <= 8, -> (h2 [m, d], qkv [m, nq]). `programs`: one an SM, all resident (default_programs); `stages`: the
    copy ring's depth; `trial`: benchmark-only variants whose outputs are wrong ("no-wait": no waits for the tiles of
    the phase before, "no-wait-gate_up" (-down, -qkv) at one phase only, "no-epilogue", comma-joined: benchmarks/layer_gpu.py);
    `compiler_params`: e.g. a Mosaic GPU profile_dir."""
    if jax.default_backend() != "gpu":
        raise NotImplementedError("the layer kernel (grid-shared semaphores) has no interpreted form: run it on a GPU")
    device = jax.devices()[0]
    if getattr(device, "core_count", NUM_SMS) < (programs or NUM_SMS):
        raise ValueError(f"programs={programs or NUM_SMS} must all be resident (one an SM): {device.device_kind} has "
                         f"{device.core_count} SMs")
    return _decode_layer(a, h0, w, eps=eps, out_dtype=out_dtype, programs=programs, stages=stages, trial=trial,
                         compiler_params=compiler_params)


def default_programs(d: int, f: int, nq: int, programs: int | None = None) -> int:
    """`programs`, or NUM_SMS; at most the units of the layer's smallest phase, so that every program has a unit in
    every phase (a program with none would hold no piece of a tile its neighbours share, and they would wait for
    its signal)."""
    fewest = min(ph.units for ph in plan(d, f, nq, NUM_SMS))
    if programs is None:
        return min(NUM_SMS, fewest)
    if not 1 <= programs <= min(NUM_SMS, fewest):
        raise ValueError(f"programs={programs} must be 1-{min(NUM_SMS, fewest)}: one an SM (NUM_SMS={NUM_SMS}), "
                         f"and at most the {fewest} units (tiles times steps) of this layer's smallest phase")
    return programs


TRIALS = ("no-wait", "no-wait-gate_up", "no-wait-down", "no-wait-qkv", "no-epilogue")


def _check(a: jax.Array, h0: jax.Array, w: LayerWeights, stages: int, trial: str) -> None:
    unknown = set(filter(None, trial.split(","))) - set(TRIALS)
    if unknown:
        raise ValueError(f"trial={trial!r}: unknown {sorted(unknown)}; the trials are {', '.join(TRIALS)}")
    m, d = a.shape
    f, nq = w.gate_up.shape[0], w.qkv.shape[0]
    if not supports(m, d, f, nq):
        raise ValueError(f"the layer kernel takes m <= {ROW_MULTIPLE} rows, d a multiple of {SS_ROWS * ROWS}, f a "
                         f"multiple of {BLOCK_K} and nq of {BLOCK_N}; got m={m}, d={d}, f={f}, nq={nq}")
    want = {"h0": (h0.shape, (m, d)), "wo": (w.wo.shape, (d, d)), "wo_scales": (w.wo_scales.shape, (d,)),
            "mlp_norm": (w.mlp_norm.shape, (d,)), "gate_up": (w.gate_up.shape, (f, 2, d)),
            "gate_up_scales": (w.gate_up_scales.shape, (2, f)), "down": (w.down.shape, (d, f)),
            "down_scales": (w.down_scales.shape, (d,)), "attn_norm": (w.attn_norm.shape, (d,)),
            "qkv": (w.qkv.shape, (nq, d)), "qkv_scales": (w.qkv_scales.shape, (nq,))}
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"{name} has shape {tuple(got)}; the layer of a {tuple(a.shape)} input needs {expected}")
    for name in ("wo", "gate_up", "down", "qkv"):
        if getattr(w, name).dtype != jnp.int8:
            raise ValueError(f"{name} must be int8 values, got {getattr(w, name).dtype}")
    for name in ("wo_scales", "gate_up_scales", "down_scales", "qkv_scales"):
        if getattr(w, name).dtype != jnp.float32:
            raise ValueError(f"{name} must be float32, got {getattr(w, name).dtype}")
    if w.attn_norm.dtype != w.mlp_norm.dtype:
        raise ValueError(f"the norms' gains must share a dtype: mlp_norm {w.mlp_norm.dtype}, attn_norm "
                         f"{w.attn_norm.dtype}")
    if not 2 <= stages <= 5:
        raise ValueError(f"stages={stages} must be 2-5 (the ring in shared memory)")


def _decode_layer(a, h0, w, *, eps, out_dtype=None, programs=None, stages=STAGES, trial="", compiler_params=None):
    """decode_layer without the device checks (tests lower it for CUDA on the CPU)."""
    _check(a, h0, w, stages, trial)
    programs = default_programs(a.shape[1], w.gate_up.shape[0], w.qkv.shape[0], programs)
    m, d = a.shape
    f, nq = w.gate_up.shape[0], w.qkv.shape[0]
    phases = plan(d, f, nq, programs)
    out_dtype = jnp.dtype(out_dtype or h0.dtype)
    a16 = activation_rows(a, ROW_MULTIPLE)
    h0p = jnp.pad(h0, ((0, ROW_MULTIPLE - m), (0, 0)))
    slots = max(ph.slots for ph in phases)
    mp = ROW_MULTIPLE
    int8_swizzle = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        functools.partial(_kernel, phases=phases, programs=programs, eps=eps, trial=trial),
        out_type=(
            jax.ShapeDtypeStruct((mp, d), h0.dtype),  # h2
            jax.ShapeDtypeStruct((mp, nq), out_dtype),  # qkv
            jax.ShapeDtypeStruct((mp, d), h0.dtype),  # h1 (scratch)
            jax.ShapeDtypeStruct((mp, d), jnp.float16),  # gate_up's, then qkv's activations (scratch)
            jax.ShapeDtypeStruct((mp, f), jnp.float16),  # down's activations (scratch)
            jax.ShapeDtypeStruct((2, d // ROWS, mp), jnp.float32),  # sums of squares of h1, h2 (scratch)
            jax.ShapeDtypeStruct((max(slots, 2), sum(ph.n for ph in phases), mp), jnp.float32),  # pieces' sums by
            # place (0, the owner's, unused) and phase (scratch)
        ),
        scratch_types=(
            plgpu.SMEM((stages, mp, BLOCK_K), jnp.float16, transforms=mma_transforms(jnp.float16)),
            plgpu.SMEM((stages, BLOCK_N, BLOCK_K), jnp.int8, transforms=int8_swizzle),
            plgpu.SMEM((2, 2, ROWS, mp), jnp.float32),  # a fragment's sums, compute -> epilogue, two deep
            plgpu.SMEM((2, ROWS, mp), jnp.float32),  # sums of squares on their way out, by half
            plgpu.SMEM((2, mp, ROWS), h0.dtype),
            plgpu.SMEM((2, mp, ROWS), jnp.float16),
            plgpu.SMEM((2, mp, ROWS), out_dtype),
            plgpu.SMEM((2, ROWS), jnp.float32),  # an owner's scales
            plgpu.SMEM((2, ROWS), w.mlp_norm.dtype),  # gain
            plgpu.SMEM((2, mp, ROWS), h0.dtype),  # residual
            plgpu.SMEM((2, d // ROWS, mp), jnp.float32),  # the sums of squares of h1, h2, for their 1/rms
            plgpu.SMEM((max(slots - 1, 1), 2, ROWS, mp), jnp.float32),  # the other pieces of an owner's last tile
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # a step's two weight halves and activations
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups done with a slot
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # a fragment's sums handed over (both halves)
            plgpu.Barrier(num_arrivals=1, num_barriers=2),  # ... and taken: the buffer is free
            plgpu.Barrier(num_arrivals=2, num_barriers=max(slots - 1, 1)),  # a piece gathered (both halves)
            plgpu.Barrier(num_arrivals=1),  # the epilogue done with the gathered pieces
            plgpu.Barrier(num_arrivals=1, num_barriers=2),  # scales
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # gain and residual
            plgpu.Barrier(num_arrivals=1),  # sums of squares
        ),
        grid=(programs,), grid_names=("p",), num_threads=4, thread_name="wg", compiler_params=compiler_params,
    )
    outs = kernel(a16, h0p, w.wo, w.wo_scales, w.mlp_norm, w.gate_up.reshape(f, 2 * d), w.gate_up_scales, w.down,
                  w.down_scales, w.attn_norm, w.qkv, w.qkv_scales)
    return outs[0][:m], outs[1][:m]
