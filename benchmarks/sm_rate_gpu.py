"""How fast one SM streams int8 weights, against how many SMs stream at once (the int8 matmul, stream-K programs).

Decode's products leave SMs idle at their ends (a partial last wave, programs that finish early); whether an idle
SM's share of HBM goes to the SMs still streaming decides whether only balance pays. Device time of a large
product [8, 4096] · [65536, 4096]ᵀ (268 MB of int8: fixed costs are ~1 %) with P programs, one an SM, against the
device copy measured in the same run.

    PYTHONPATH=. python3 benchmarks/sm_rate_gpu.py   # writes benchmarks/results/sm_rate_gpu.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import ring_probes  # noqa: E402
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import device_seconds  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth_device  # noqa: E402
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu  # noqa: E402
from pallas_kernels.quantized_matmul import quantized_matmul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", default="16,33,66,99,132")
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--probe", default=",copies",
                    help="what the programs do, comma separated: '' (the product, bfloat16 operands), 'float16' (the "
                         "product in float16: BlockSizes.float16), or a stand-in of benchmarks/ring_probes.py: "
                         "'copies' (stream the tiles only), 's8' (int8 wgmma from shared memory), 's8chunk' (s8 with an "
                         "int32 accumulator a 128-input run, scaled into float32)")
    ap.add_argument("--out", default="benchmarks/results/sm_rate_gpu.jsonl")
    args = ap.parse_args()
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    copy = copy_bandwidth_device()
    key = jax.random.PRNGKey(0)
    values = jax.random.randint(key, (args.n, args.k), -127, 128, jnp.int32).astype(jnp.int8)
    scales = jnp.full((1, args.n), 1 / 127, jnp.float32)
    x = jax.random.normal(key, (8, args.k), jnp.float32).astype(jnp.bfloat16)
    lines = [f"device copy {copy / 1e9:.0f} GB/s"]
    for probe, p in ((q, int(v)) for q in args.probe.split(",") for v in args.programs.split(",")):
        bs = qmm_gpu.BlockSizes(stream_k=True, programs=p, float16=probe == "float16")
        fn = jax.jit(lambda *a, bs=bs: quantized_matmul(*a, backend="mosaic_gpu", block_sizes=bs))
        with ring_probes.probe(probe if probe in ring_probes.PROBES else None):  # fn traces just below
            t = device_seconds(fn, (x, values, scales), reps=5)
            got = fn(x, values, scales).astype(jnp.float32)
        want = jnp.dot(x.astype(jnp.float32), values.astype(jnp.float32).T) * scales
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        rate = args.n * args.k / t
        config = {"n": args.n, "k": args.k, "programs": p, "probe": probe}
        record(args.out, "int8_stream_rate_by_programs", config, "GB/s", rate / 1e9, "GB/s", "device copy", copy / 1e9)
        lines.append(f"{probe or 'full':>8} {p:>4} programs: {t * 1e6:7.1f} us, {rate / 1e9:6.0f} GB/s "
                     f"({rate / copy:.2f} of copy), {rate / p / 1e9:5.1f} GB/s a program, error {err:.1e}")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
