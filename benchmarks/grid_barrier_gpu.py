"""What a grid-wide barrier costs inside one Mosaic GPU kernel, against a kernel boundary.

A decode step's int8 products each lose 2-4 µs beyond their bytes to their own start and end (the first tiles'
latency, the last step, the epilogue), which a kernel boundary keeps from overlapping anything (see
int8_gpu_notes.md, session 18). One kernel spanning several products would replace each boundary by a barrier
across its programs, behind which the copy ring can already stream the next weight. This measures the barrier:
`--programs` programs (one an SM: all resident, which a barrier needs), each signalling a global semaphore and
waiting until every program has, `phases` times in a row. The slope over phases is one barrier; a chain of
one-phase kernels (start to start, from a profile) gives a kernel boundary in the same run.

    PYTHONPATH=. python3 benchmarks/grid_barrier_gpu.py [--programs 132] [--phases 1,16,64]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.decode_profile_gpu import busy_ns, device_profile  # noqa: E402
from benchmarks.kernels_gpu import kernel_seconds  # noqa: E402
from pallas_kernels import backend as backend_lib  # noqa: E402
from pallas_kernels.quantized_mlp.mosaic_gpu import depart  # noqa: E402


def barrier_kernel(programs: int, phases: int):
    """x [programs, 128] int32 (unread: it orders the calls) -> every row `phases`, written after `phases` grid
    barriers."""

    def body(x_ref, o_ref, row):
        # semaphores shared by the whole grid (scratch_types would give each program its own)
        arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((phases,)))
        p = jax.lax.axis_index("p")
        for phase in range(phases):
            plgpu.semaphore_signal(arrived.at[phase], 1, memory_scope="gpu")
            plgpu.semaphore_wait(arrived.at[phase], programs, decrement=False, memory_scope="gpu")
        # once every program has passed every phase, the counts go back to 0 for the next call
        depart(p, programs, [(arrived.at[phase], programs) for phase in range(phases)])

        row[...] = jnp.full((128,), phases, jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(row, o_ref.at[p])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs, 128), jnp.int32),
                        scratch_types=(plgpu.SMEM((128,), jnp.int32),),
                        grid=(programs,), grid_names=("p",))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=backend_lib.NUM_SMS)
    ap.add_argument("--phases", default="1,16,64")
    ap.add_argument("--chain", type=int, default=64, help="kernels in the chain that gives a kernel boundary")
    ap.add_argument("--out", default="benchmarks/results/grid_barrier_gpu.jsonl")
    args = ap.parse_args()
    x = jnp.asarray(np.arange(args.programs * 128, dtype=np.int32).reshape(args.programs, 128))
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    phase_counts = [int(p) for p in args.phases.split(",")]
    if jax.default_backend() == "cpu":  # not interpreted (Mosaic GPU's interpreter could not allocate semaphores)
        for phases in phase_counts:
            jax.jit(barrier_kernel(args.programs, phases)).trace(x).lower(lowering_platforms=("cuda",))
        return print(f"lowered for CUDA with {phase_counts} phases (no GPU here: nothing timed)")
    per_call = {}
    for phases in phase_counts:
        f = jax.jit(barrier_kernel(args.programs, phases))
        got = jax.block_until_ready(f(x))  # a barrier that never opens hangs here
        if not np.array_equal(np.asarray(got), np.full(x.shape, phases)):
            raise AssertionError(f"the barrier kernel of {phases} phases left rows unwritten")
        seconds, count = kernel_seconds(lambda f=f: [jax.block_until_ready(f(x)) for _ in range(20)], "")
        per_call[phases] = seconds / count
        print(f"phases {phases:4d}: {per_call[phases] * 1e6:8.2f} us a kernel", flush=True)
    one = jax.jit(barrier_kernel(args.programs, 1))

    def chained(x):
        for _ in range(args.chain):
            x = one(x)
        return x

    f = jax.jit(chained)
    jax.block_until_ready(f(x))
    intervals, _, _ = device_profile(lambda: jax.block_until_ready(f(x)))
    _, span = busy_ns(intervals)
    boundary = span / 1e9 / len(intervals)  # start to start: a one-phase kernel and the gap to the next
    ps = sorted(per_call)
    slope = (per_call[ps[-1]] - per_call[ps[0]]) / (ps[-1] - ps[0])
    print(f"a grid barrier: {slope * 1e6:.2f} us; a chained one-phase kernel: {boundary * 1e6:.2f} us")
    config = {"programs": args.programs, "phases": ps, "chain": args.chain}
    record(args.out, "grid_barrier", config, "seconds", slope, "s", "chained one-phase kernel", boundary,
           higher_is_better=False)


if __name__ == "__main__":
    main()
