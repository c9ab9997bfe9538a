"""The int8 MLP on the GPU: the separate kernels (gate_up, SiLU·up in XLA, down: the model's path), gate_up_silu +
down, and the fused kernel.

8B shapes (d 4096, f 14336), random int8 weights, decode rows (padded to 8 as the step passes them).
Device time from a profile (all kernels of a call, no launch gaps), checked against float64 first.

    PYTHONPATH=. python3 benchmarks/mlp_gpu.py        # writes benchmarks/results/mlp_gpu.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import device_seconds  # noqa: E402
from pallas_kernels.quantized_matmul import quantized_matmul  # noqa: E402
from pallas_kernels.quantized_mlp import mosaic_gpu  # noqa: E402


def separate_kernels(x, r, gu, gs, dw, ds):
    """What the model runs today: the int8 matmul kernel twice, SiLU·up (and r) in XLA between them."""
    m, d = x.shape
    f = gu.shape[0]
    g = quantized_matmul(x, gu.reshape(2 * f, d), gs.reshape(1, 2 * f), backend="mosaic_gpu")
    g = (g.reshape(m, f, 2) * r[:, None, None]).astype(x.dtype)
    act = jax.nn.silu(g[..., 0]) * g[..., 1]
    return quantized_matmul(act, dw, ds, backend="mosaic_gpu", out_dtype=jnp.float32)


def gate_up_silu_then_down(x, r, gu, gs, dw, ds):
    """gate_up with SiLU·up in its epilogue (one kernel), then the down kernel (the model does not take it: see
    quantized_mlp.mosaic_gpu.gate_up_silu)."""
    act = mosaic_gpu.gate_up_silu(x, r, gu, gs)
    return quantized_matmul(act, dw, ds, backend="mosaic_gpu", out_dtype=jnp.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,1")
    ap.add_argument("--splits", default="0,4,8,14", help="down splits of the fused kernel (0: its plan's choice)")
    ap.add_argument("--stages", default="3", help="ring depths of the fused kernel")
    ap.add_argument("--profile-dir", default="", help="also trace the fused kernel's named regions per warpgroup "
                                                        "(Mosaic GPU's profiler) into this directory, then exit")
    ap.add_argument("--out", default="benchmarks/results/mlp_gpu.jsonl")
    args = ap.parse_args()
    d, f = 4096, 14336
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    gu = jax.random.randint(k1, (f, 2, d), -127, 128, jnp.int32).astype(jnp.int8)
    dw = jax.random.randint(k2, (d, f), -127, 128, jnp.int32).astype(jnp.int8)
    gs = jax.random.uniform(k3, (1, f, 2), jnp.float32, 0.5, 2.0) / 127 / 64
    ds = jax.random.uniform(k4, (1, d), jnp.float32, 0.5, 2.0) / 127
    lines = []
    if args.profile_dir:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        x = jax.random.normal(k5, (8, d), jnp.float32).astype(jnp.bfloat16)
        params = plgpu.CompilerParams(profile_space=64, profile_dir=args.profile_dir)
        inputs = (x, jnp.ones(8, jnp.float32), gu, gs, dw, ds)
        for splits in (int(v) for v in args.splits.split(",")):
            # Mosaic GPU traces only a kernel's first call: the clocks are warmed by the unprofiled kernel first
            plain = jax.jit(lambda *a, s=splits: mosaic_gpu.quantized_mlp(*a, splits=s or None))
            device_seconds(plain, inputs)
            fn = jax.jit(lambda *a, s=splits: mosaic_gpu.quantized_mlp(*a, splits=s or None, compiler_params=params))
            jax.block_until_ready(fn(*inputs))
        print(sorted(os.listdir(args.profile_dir)))
        return
    for m in (int(v) for v in args.rows.split(",")):
        x = jax.random.normal(jax.random.fold_in(k5, m), (m, d), jnp.float32).astype(jnp.bfloat16)
        r = jnp.linspace(0.5, 1.5, m, dtype=jnp.float32)
        inputs = (x, r, gu, gs, dw, ds)
        want = np.asarray(jax.jit(separate_kernels)(*inputs), np.float64)
        base = device_seconds(jax.jit(separate_kernels), inputs)
        lines.append(f"rows {m}: separate kernels {base * 1e6:.1f} us")
        fn = jax.jit(gate_up_silu_then_down)
        err = float(np.linalg.norm(np.asarray(fn(*inputs), np.float64) - want) / np.linalg.norm(want))
        t = device_seconds(fn, inputs)
        record(args.out, "int8_mlp_gate_up_silu_device", {"d": d, "f": f, "m": m, "error_vs_separate": err},
               "us", t * 1e6, "us", "separate kernels", base * 1e6, higher_is_better=False)
        lines.append(f"rows {m}: gate_up_silu + down {t * 1e6:.1f} us ({base / t:.3f}x), error vs separate {err:.2e}")
        print(lines[-1], flush=True)
        for splits, stages in ((int(a), int(b)) for a in args.splits.split(",") for b in args.stages.split(",")):
            fn = jax.jit(lambda *a, s=splits, n=stages: mosaic_gpu.quantized_mlp(*a, splits=s or None, stages=n))
            got = np.asarray(fn(*inputs), np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            t = device_seconds(fn, inputs)
            config = {"d": d, "f": f, "m": m, "splits": splits or mosaic_gpu.plan(d, f)[0], "stages": stages,
                      "error_vs_separate": err}
            record(args.out, "int8_mlp_fused_device", config, "us", t * 1e6, "us", "separate kernels", base * 1e6,
                   higher_is_better=False)
            lines.append(f"rows {m}: fused splits={config['splits']:>2} stages={stages} {t * 1e6:.1f} us ({base / t:.3f}x), "
                         f"error vs separate {err:.2e}")
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
