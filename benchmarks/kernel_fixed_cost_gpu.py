"""What one product costs beyond its bytes: chains of dependent decode-shaped products, int8 kernel against XLA.

A decode step is ~129 weight products in a row, each a kernel (or two, with its k splits summed) that waits for
the one before it. For the small ones (wo is 16.8 MB in int8) the time a kernel takes whatever its size matters as
much as its bytes. Here each chain is `--length` products x [8, n] · [n, n]ᵀ, each product's output the next one's
input, compiled as one program; the weight is small enough to stay in L2 after the first product, so what is left
is the kernels' own cost: launch, the first copies' latency, the pipeline's fill and the epilogue.

For each size, in one process: device time per product (from a profile of three calls: every kernel of the chain, split
sums included) of the int8 kernel (`pallas_kernels.quantized_matmul` on Mosaic GPU, its default tiling) against XLA's
bfloat16 dot on the same weight dequantized (twice the bytes).

    PYTHONPATH=. python3 benchmarks/kernel_fixed_cost_gpu.py [--sizes 512,4096] [--length 50]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.kernels_gpu import kernel_seconds  # noqa: E402
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu  # noqa: E402

_CONTRACT_K = (((1,), (1,)), ((), ()))


def chain(product, length: int):
    def run(x, *weight):
        for _ in range(length):
            x = product(x, *weight)
        return x

    return jax.jit(run)


def mosaic_copy(x: jax.Array) -> jax.Array:
    """The least a Mosaic GPU kernel does: one program, x into shared memory by TMA and back out."""

    def body(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_types=(plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1)))(x)


def device_seconds_per_product(fn, args, length: int, reps: int = 3) -> tuple[float, float]:
    """(device seconds, kernels) per product of the chain, from one profile of `reps` calls after a first."""
    jax.block_until_ready(fn(*args))
    seconds, kernels = kernel_seconds(lambda: [jax.block_until_ready(fn(*args)) for _ in range(reps)], "")
    return seconds / reps / length, kernels / reps / length


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512,4096", help="n = k of the chained products")
    ap.add_argument("--rows", type=int, default=8, help="activation rows (a decode step pads batch 1 to 8)")
    ap.add_argument("--length", type=int, default=50, help="products per chain")
    ap.add_argument("--out", default="benchmarks/results/int8_gpu.jsonl")
    args = ap.parse_args()
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    key = jax.random.PRNGKey(0)
    table = []
    floor, _ = device_seconds_per_product(chain(mosaic_copy, args.length),
                                          (jax.random.normal(key, (args.rows, 256), jnp.bfloat16),), args.length)
    table.append(f"a Mosaic GPU kernel that copies [{args.rows}, 256] through shared memory: {floor * 1e6:6.2f} us")
    print(table[-1], flush=True)
    for n in [int(s) for s in args.sizes.split(",")]:
        x = jax.random.normal(key, (args.rows, n), jnp.bfloat16)
        values = jax.random.randint(key, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
        scales = jnp.full((1, n), 1 / 127 / n ** 0.5, jnp.float32)  # keeps the chain's activations near unit size
        dense = (values.astype(jnp.float32) * scales[0][:, None]).astype(jnp.bfloat16)
        int8 = chain(qmm_gpu.quantized_matmul, args.length)
        xla = chain(lambda x, w: jax.lax.dot_general(x, w, _CONTRACT_K, preferred_element_type=jnp.float32)
                    .astype(jnp.bfloat16), args.length)
        ours, ours_kernels = device_seconds_per_product(int8, (x, values, scales), args.length)
        base, base_kernels = device_seconds_per_product(xla, (x, dense), args.length)
        config = {"n": n, "k": n, "m": args.rows, "chain": args.length, "tiling": str(qmm_gpu._resolve(
            qmm_gpu.DEFAULT_BLOCK_SIZES, args.rows, n, n, n)), "kernels_per_product": ours_kernels,
            "xla_kernels_per_product": base_kernels, "mosaic_copy_kernel_seconds": floor}
        record(args.out, "int8_product_fixed_cost", config, "device_seconds_per_product", ours, "s",
               "XLA bfloat16 dot, same chain", base, higher_is_better=False)
        line = (f"n=k={n:5d}: int8 kernel {ours * 1e6:6.2f} us a product ({ours_kernels:.0f} kernels), XLA bfloat16 "
                f"dot {base * 1e6:6.2f} us ({base_kernels:.0f} kernels): int8/XLA {ours / base:5.2f}")
        print(line, flush=True)
        table.append(line)
    print("\n".join(table))


if __name__ == "__main__":
    main()
