"""Paged decode attention variants on the H100: who converts float8 pages' 8-bit tiles, and scores as K·qᵀ.

In one run, per (batch, context): the Mosaic GPU decode kernel over bf16 pages (its default tiling, and with
transposed scores: `BlockSizes.transposed`, the query group as the wgmma N), over float8 pages with the
compute warpgroup converting each tile (the default until session 11), with a third warpgroup converting one
block ahead (`BlockSizes.convert_warpgroup`, the default since), and both with transposed scores.
Each is 20 calls in one jit, timed; rows give K/V bytes over time against the device copy measured in
the same run, and the ratio against the variant's baseline (bf16: the default; float8: the compute warpgroup
converting). Outputs are checked against the reference where the inputs are small.

    PYTHONPATH=. python3 benchmarks/fp8_decode_gpu.py [--shapes 128x2048,256x1536]
    .venv/bin/python benchmarks/fp8_decode_gpu.py --smoke      # interpreted on CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record, repeated, timed  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth, rel_err  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.paged_attention import mosaic_gpu as decode_gpu  # noqa: E402
from pallas_kernels.paged_attention import reference as decode_ref  # noqa: E402

BS = decode_gpu.BlockSizes
FP8 = jnp.float8_e4m3fn
# name: (page dtype, tiling, the variant it is compared with); tiling None: the kernel's default (fp8-default:
# float8_block_sizes, the converting warpgroup over 128-token blocks, its scores transposed for split sequences);
# fp8-compute-wg: the default before session 11
VARIANTS = {
    "bf16": (jnp.bfloat16, None, "bf16"),
    "bf16-transposed": (jnp.bfloat16, BS(transposed=True), "bf16"),
    "fp8-compute-wg": (FP8, BS(), "fp8-compute-wg"),
    "fp8-default": (FP8, None, "fp8-compute-wg"),
    "fp8-transposed": (FP8, BS(transposed=True), "fp8-compute-wg"),
    # one slot a program, as fp8-default's converter tiling: the two differ only in `transposed`
    "fp8-converter-wg-transposed": (FP8, BS(convert_warpgroup=True, transposed=True, slots_per_program=1),
                                    "fp8-compute-wg"),
    "fp8-converter-wg-transposed-bk64": (FP8, BS(block_k=64, stages=3, convert_warpgroup=True, transposed=True),
                                         "fp8-compute-wg"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x1536,128x2048,32x8192,8x8192,1x8192",
                    help="batch x context, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu.jsonl")
    args = ap.parse_args()
    heads, kv, hd, ps, reps = 32, 8, 128, 16, 20
    interpret = None
    if args.smoke:
        args.shapes, heads, kv, reps, interpret, args.out = "2x256", 4, 1, 1, True, "/tmp/fp8_decode_smoke.jsonl"
    copy_bw = copy_bandwidth() if not args.smoke else float("nan")
    print(f"{jax.devices()[0]} jax {jax.__version__}; device copy {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rng = np.random.default_rng(0)
    table_rows = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        pages = ctx // ps
        ks = jax.random.split(jax.random.PRNGKey(batch * ctx), 3)
        k16 = jax.random.normal(ks[0], (kv, batch * pages, ps, hd), jnp.bfloat16)
        v16 = jax.random.normal(ks[1], (kv, batch * pages, ps, hd), jnp.bfloat16)
        q = jax.random.normal(ks[2], (batch, heads, hd), jnp.bfloat16)
        table = jnp.asarray(testing.random_page_table(rng, batch, pages, batch * pages))
        lengths = jnp.full((batch,), ctx - 1, jnp.int32)  # the last block partial: its masked path runs
        times, expected = {}, {}  # the reference's output per page dtype, computed once
        for name in args.variants.split(","):
            dtype, bs, baseline = VARIANTS[name]
            kp, vp = k16.astype(dtype), v16.astype(dtype)
            nbytes = 2 * batch * ctx * kv * hd * jnp.dtype(dtype).itemsize
            if bs is None and dtype == FP8:  # the default, resolved as the kernel resolves it, for the record
                bs = decode_gpu.float8_block_sizes(batch, kv, heads // kv, ctx, hd, 2)
            call = functools.partial(decode_gpu.paged_attention, block_sizes=bs, interpret=interpret)
            try:
                out = jax.jit(call)(q, kp, vp, table, lengths)
                if nbytes <= 2 << 30 and dtype not in expected:
                    expected[dtype] = jax.jit(decode_ref.paged_attention)(q, kp, vp, table, lengths)
                err = rel_err(out, expected[dtype]) if dtype in expected else None
                t = timed(repeated(call, reps), q, kp, vp, table, lengths, reps=1 if args.smoke else 5) / reps
            except Exception as e:  # noqa: BLE001 (a tiling that does not fit is reported, the rest still run)
                print(f"  {shape} {name}: failed {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            times[name] = t
            base = times.get(baseline)
            config = dict(timing=f"{reps} calls in one jit", batch=batch, context=ctx, heads=heads, kv_heads=kv,
                          head_dim=hd, page_size=ps, kv_dtype=jnp.dtype(dtype).name, variant=name,
                          block_sizes=str(bs) if bs else "default", err_vs_reference=err, seconds=t,
                          splits=decode_gpu.split_layout(batch, kv, ctx, bs or BS())[0],
                          compared_with=baseline, speedup=(base / t) if base else None)
            record(args.out, "paged_decode_fp8_conversion", config, "kv_bandwidth", nbytes / t / 1e12, "TB/s",
                   "device_copy", copy_bw / 1e12)
            line = (f"b{batch:<4d} ctx {ctx:5d}  {name:34s} {t * 1e6:8.1f} us  {nbytes / t / 1e12:5.2f} TB/s "
                    f"({nbytes / t / copy_bw:6.1%} of copy)  vs {baseline:15s} "
                    f"{(base / t) if base else float('nan'):5.2f}x  err {err if err is not None else float('nan'):.1e}")
            if err is not None and err > 2e-2:  # bf16 outputs agree to ~3e-3: this one is wrong, whatever its speed
                line += "  WRONG: error past 2e-2"
            print(line, flush=True)
            table_rows.append(line)
    print("\n".join(table_rows))


if __name__ == "__main__":
    main()
