"""The performance skeleton of a persistent int8 layer kernel: what a decode step's products would cost if one
kernel ran them all, against one kernel per product, on the H100.

With one Mosaic GPU kernel per product, a 32-layer int8 step stays at or below 1.69x bfloat16 even when the
products do no work on the bytes they stream (`int8_gpu.py --variants int8@probe=copies`, session 22): each
product's start and end, and the small kernels between products, cost as much as a layer's bytes do. A kernel
that runs every product of the layers one after another would replace each boundary by a grid barrier, behind
which the copy ring already streams the next product's weight.

The skeleton runs that schedule without the numerics around the products. 132 programs (one an SM) take the
phases wo, gate_up, down, qkv of each layer in turn (weights of `--layers` layers, each its own bytes). In each
phase program p streams an equal run of the phase's (128-row tile, 256-input step) units (stream-K) through one
copy ring that runs on across phases. The products are int8 wgmma from shared memory (the "s8" probe's loop:
the weight tile is A, an int8 B of 8 columns read K-major is the activations' stand-in); each phase's B [8, k]
is copied from global memory into shared memory after the grid barrier that ends the phase before, as a real
kernel would copy the activations the phase before wrote; each piece of an output tile is stored in float32.
What it leaves out: the norms, SiLU·up and the activations' split into int8 parts (a few KB per phase), and the
summing of the partial tiles. Its outputs are not checked: the time is the point.

The baseline, in the same run and process: the same products by the int8 kernel the model uses (one kernel each,
the same weights, chained so each waits for the one before), by device time from a profile. Also timed: the same
skeleton launched once a layer (what a layer kernel's start and end cost, against every layer in one kernel).

    PYTHONPATH=. python3 benchmarks/layer_skeleton_gpu.py [--layers 4]   # writes results/layer_skeleton_gpu.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, device_seconds  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth_device  # noqa: E402
from pallas_kernels import backend as backend_lib  # noqa: E402
from pallas_kernels.decode_megakernel.mosaic_gpu import BLOCK_K, BLOCK_N, COLS, layer_products, s8_sums  # noqa: E402
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu  # noqa: E402
from pallas_kernels.quantized_mlp.mosaic_gpu import depart  # noqa: E402

PHASES = ("wo", "w_gate_up", "w_down", "wqkv")  # a layer's products in the order a decode step runs them



def skeleton(shapes: list[tuple[int, int]], layers: int, programs: int, stages: int, barriers: bool = True,
             reload: bool = True, b_cols: int | None = None, after: bool = False):
    """The kernel: (weights [layers · n, k] int8 and B [8, k] int8 for each of `shapes`) -> an output [8, n]
    float32 each (the last layer's; every layer's pieces write over the layer's before). Trials: `barriers`
    False leaves out the grid barriers (phases overlap where programs drift apart; it may also hang: warpgroup 0 can
    complete B's barrier for the next phase before warpgroup 1 has waited on this one's, which then waits on the
    wrong phase; it did not in the runs of session 22); `reload` False copies the
    widest B once at the start and every phase reads it (no copy after each barrier); `b_cols` keeps at most
    that many columns of B in shared memory (a phase reads them cyclically), which leaves room for a deeper ring:
    what a kernel copying only each program's k range of B would have. `after`: one more input, not read (the
    outputs of a kernel this one must follow)."""
    kinds = len(shapes)
    k_max = min(max(k for _, k in shapes), b_cols or 1 << 30)
    units = [(n // BLOCK_N) * (k // BLOCK_K) for n, k in shapes]
    fragments = [qmm_gpu.stream_k_plan(k // BLOCK_K, n // BLOCK_N, programs)[1] for n, k in shapes]

    def run_of(kind, p):  # program p's units of a phase of this kind
        return lax.div(p * units[kind], programs), lax.div((p + 1) * units[kind], programs)

    def body(*refs):
        w_refs, b_refs = refs[:kinds], refs[kinds:2 * kinds]
        refs = refs[2 * kinds + after:]
        o_refs = refs[:kinds]
        w_smem, b_smem, o_smem, tile_bar, free_bar, b_bar = refs[kinds:]
        p, wg = lax.axis_index("p"), lax.axis_index("wg")
        # a program's ring position at the start of a layer: the units of every phase before, which depend on p only
        per_layer = sum(e - b for b, e in (run_of(kind, p) for kind in range(kinds)))

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def layer(layer_index, carry):
                g0 = layer_index * per_layer
                for kind, (n, k) in enumerate(shapes):
                    begin, end = run_of(kind, p)
                    steps = k // BLOCK_K

                    def step(u, carry, kind=kind, begin=begin, steps=steps, n=n):
                        g = carry + u - begin
                        slot = lax.rem(g, stages)

                        @pl.when(g >= stages)
                        def _():
                            plgpu.barrier_wait(free_bar.at[slot])

                        rows = pl.ds(layer_index * n + lax.div(u, steps) * BLOCK_N, BLOCK_N)
                        plgpu.copy_gmem_to_smem(w_refs[kind].at[rows, pl.ds(lax.rem(u, steps) * BLOCK_K, BLOCK_K)],
                                                w_smem.at[slot], tile_bar.at[slot])
                        return carry

                    lax.fori_loop(begin, end, step, g0)
                    g0 = g0 + end - begin
                return carry

            lax.fori_loop(0, layers, layer, None)
            total = layers * per_layer
            qmm_gpu.drain(free_bar, stages, jnp.maximum(total - stages, 0), total)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((layers * kinds,)))
            rows = pl.ds(pl.multiple_of(wg * qmm_gpu.ROWS, qmm_gpu.ROWS), qmm_gpu.ROWS)

            def layer(layer_index, carry):
                g0 = layer_index * per_layer
                for kind, (_, k) in enumerate(shapes):
                    phase = layer_index * kinds + kind
                    begin, end = run_of(kind, p)
                    steps = k // BLOCK_K

                    @pl.when((phase > 0) & barriers)
                    def _(phase=phase):  # every program is done with the phase before (its outputs: this one's input)
                        plgpu.semaphore_wait(arrived.at[phase - 1], 2 * programs, decrement=False,
                                             memory_scope="gpu")

                    widest = max(range(kinds), key=lambda i: shapes[i][1])

                    @pl.when((wg == 0) & (reload | (phase == 0)))
                    def _(kind=kind if reload else widest):
                        cols = min(shapes[kind][1], k_max)
                        plgpu.copy_gmem_to_smem(b_refs[kind].at[:, pl.ds(0, cols)], b_smem.at[:, pl.ds(0, cols)], b_bar)

                    @pl.when(reload | (phase == 0))
                    def _():
                        plgpu.barrier_wait(b_bar)

                    def fragment(tile, kind=kind, begin=begin, end=end, steps=steps, k=k, g0=g0):
                        @pl.when(tile <= lax.div(end - 1, steps))
                        def _():
                            start = jnp.maximum(begin, tile * steps)
                            stop = jnp.minimum(end, (tile + 1) * steps)

                            def b_of(slot, u, c, steps=steps, k=k):
                                k_at = lax.rem(lax.rem(u, steps) * BLOCK_K, min(k, k_max))
                                return b_smem.at[:, pl.ds(k_at + c, 128)]

                            acc = s8_sums(w_smem, tile_bar, free_bar, rows, start, stop,
                                          lambda u: lax.rem(g0 + u - begin, stages), b_of)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            qmm_gpu.store_transposed(acc.astype(jnp.float32), o_smem.at[wg], interpreted=False)
                            plgpu.commit_smem()
                            cols = pl.ds(tile * BLOCK_N + wg * qmm_gpu.ROWS, qmm_gpu.ROWS)
                            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_refs[kind].at[:, cols])

                    first_tile = lax.div(begin, steps)
                    for f in range(fragments[kind]):
                        fragment(first_tile + f)
                    plgpu.wait_smem_to_gmem(0)  # this phase's outputs are in global memory before the signal
                    plgpu.semaphore_signal(arrived.at[phase], 1, memory_scope="gpu")
                    g0 = g0 + end - begin
                return carry

            lax.fori_loop(0, layers, layer, None)
            # both warpgroups of every program depart once past their last wait; the first resets the semaphores
            depart(2 * p + wg, 2 * programs, [(arrived.at[i], 2 * programs) for i in range(layers * kinds)])

    int8_swizzle = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    return plgpu.kernel(
        body,
        out_type=tuple(jax.ShapeDtypeStruct((COLS, n), jnp.float32) for n, _ in shapes),
        scratch_types=(
            plgpu.SMEM((stages, BLOCK_N, BLOCK_K), jnp.int8, transforms=int8_swizzle),
            plgpu.SMEM((COLS, k_max), jnp.int8, transforms=int8_swizzle),
            plgpu.SMEM((2, COLS, qmm_gpu.ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1),
        ),
        grid=(programs,), grid_names=("p",), num_threads=3, thread_name="wg",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--programs", type=int, default=backend_lib.NUM_SMS)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--b-cols", type=int, default=0, help="columns of B kept in shared memory (0: all; see skeleton)")
    ap.add_argument("--trial", default="", choices=["", "no-barriers", "no-reload"],
                    help="leave out the grid barriers, or the copy of B after each one (see skeleton)")
    ap.add_argument("--out", default="benchmarks/results/layer_skeleton_gpu.jsonl")
    args = ap.parse_args()
    if args.b_cols % BLOCK_K:
        ap.error(f"--b-cols must be a multiple of {BLOCK_K} (a step's inputs), got {args.b_cols}")
    if not 1 <= args.programs <= backend_lib.NUM_SMS:
        ap.error(f"--programs must be 1-{backend_lib.NUM_SMS}: a grid barrier needs every program resident (one an "
                 f"SM), got {args.programs}")
    products = layer_products(LLAMA_8B)
    shapes = [products[name] for name in PHASES]
    kernel = skeleton(shapes, args.layers, args.programs, args.stages, barriers=args.trial != "no-barriers",
                      reload=args.trial != "no-reload", b_cols=args.b_cols or None)
    key = jax.random.PRNGKey(0)
    weights = [jax.random.randint(key, (args.layers * n, k), -127, 128, jnp.int32).astype(jnp.int8)
               for n, k in shapes]
    bs = [jax.random.randint(key, (COLS, k), -127, 128, jnp.int32).astype(jnp.int8) for _, k in shapes]
    scales = [jnp.full((1, n), 1 / 127, jnp.float32) for n, _ in shapes]

    def separate(per_layer, x):  # the model's kernel, one product at a time, each taking the one before's output
        for layer_weights in per_layer:
            for kind, (w, s) in enumerate(zip(layer_weights, scales)):
                x = qmm_gpu.quantized_matmul(x, w, s, interpret=False)[:, :shapes[(kind + 1) % kinds][1]]
        return x

    layer_kernel = skeleton(shapes, 1, args.programs, args.stages, barriers=args.trial != "no-barriers",
                            reload=args.trial != "no-reload", b_cols=args.b_cols or None, after=True)

    def kernel_a_layer(per_layer, bs):  # the same schedule, one kernel a layer, each taking the one before's first
        # output as an input it does not read: that orders the launches and keeps every one (with the outputs only
        # through an optimization_barrier, XLA dropped all but the last: session 27's first run timed one layer)
        outs = (bs[0],)  # the first follows nothing
        for layer_weights in per_layer:
            outs = layer_kernel(*layer_weights, *bs, outs[0])
        return outs

    kinds = len(shapes)
    x = jax.random.normal(key, (COLS, shapes[0][1]), jnp.float32).astype(jnp.bfloat16)
    per_layer = [[w[layer * n:(layer + 1) * n] for (n, _), w in zip(shapes, weights)] for layer in range(args.layers)]
    if jax.default_backend() == "cpu":  # no interpreter for grid-shared semaphores: lower only
        jax.jit(kernel).trace(*weights, *bs).lower(lowering_platforms=("cuda",))
        jax.jit(kernel_a_layer).trace(per_layer, bs).lower(lowering_platforms=("cuda",))
        jax.jit(lambda *a: separate(*a)).trace(per_layer, x).lower(lowering_platforms=("cuda",))
        return print(f"lowered for CUDA ({args.layers} layers; no GPU here: nothing timed)")
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    copy = copy_bandwidth_device()
    total_bytes = sum(w.size for w in weights)
    fused = device_seconds(jax.jit(kernel), (*weights, *bs), reps=5)
    apart = device_seconds(jax.jit(separate), (per_layer, x), reps=5)
    layered = device_seconds(jax.jit(kernel_a_layer), (per_layer, bs), reps=5)
    line = (f"{args.layers} layers, {total_bytes / 1e9:.2f} GB: one kernel {fused * 1e6:.1f} us "
            f"({total_bytes / fused / copy:.2f} of the copy, {fused / args.layers * 1e6:.1f} us a layer); one kernel "
            f"a layer {layered * 1e6:.1f} us ({total_bytes / layered / copy:.2f}, {layered / args.layers * 1e6:.1f} us "
            f"a layer); one kernel a product {apart * 1e6:.1f} us ({total_bytes / apart / copy:.2f}, "
            f"{apart / args.layers * 1e6:.1f} us a layer); copy {copy / 1e9:.0f} GB/s")
    print(line, flush=True)
    record(args.out, "int8_layer_skeleton_kernel_a_layer", {"layers": args.layers, "programs": args.programs,
                                                             "stages": args.stages, "trial": args.trial or None,
                                                             "b_cols": args.b_cols or None},
           "seconds", layered, "s", "the skeleton with every layer in one kernel (same run)", fused,
           higher_is_better=False)
    record(args.out, "int8_layer_skeleton", {"layers": args.layers, "programs": args.programs, "stages": args.stages,
                                                "trial": args.trial or None, "b_cols": args.b_cols or None},
           "seconds", fused, "s", "one int8 kernel a product (device time, chained)", apart, higher_is_better=False)


if __name__ == "__main__":
    main()
