"""Where a decode step's time goes on the GPU: an 8B-shaped Llama through jaxserve's step function.

For each variant (bfloat16, int8; float8-kv: bfloat16 weights over float8 pages) and batch, in one run:
- wall time per step, dispatching steps back to back as the engine does (no sync between steps), over 20 steps
  (with the pipeline's fill and drain: the first launch, the last read back) and over 200 (the steady state);
- against the bandwidth floor: weight bytes plus the K/V bytes a step reads, over a device copy's rate measured
  in the same run;
- from a profile of the same steps: device busy time per step (the union of kernel intervals), idle gaps split
  by size, kernels per step, the kernels that take the time grouped by name, and their time beyond the busy
  time (`overlap`: kernels running at once).

    PYTHONPATH=. python3 benchmarks/decode_profile_gpu.py [--batches 1,64] [--variants bfloat16,int8]
    .venv/bin/python benchmarks/decode_profile_gpu.py --smoke      # a tiny config on CPU (no GPU plane to profile)
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, SMOKE, decode_step, run_steps  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth  # noqa: E402
from jaxserve.config import QuantConfig  # noqa: E402
from jaxserve.model.quant import quantize_weights  # noqa: E402
from jaxserve.model.weights import param_bytes, random_weights  # noqa: E402


def step_bytes(cfg, weights, batch: int, context: int, kv_bytes: int = 2) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row of it), plus K and V."""
    embed_bytes = 0 if weights.lm_head is None else sum(x.nbytes for x in jax.tree_util.tree_leaves(weights.embed))
    kv = 2 * cfg.num_layers * batch * (context + 1) * cfg.num_kv_heads * cfg.head_dim * kv_bytes
    return param_bytes(weights) - embed_bytes + kv


def device_profile(run) -> tuple[list[tuple[int, int]], collections.Counter, collections.Counter]:
    """(kernel intervals, time per kernel name, count per kernel name) of the GPU plane of a profile taken while
    `run()` runs (it must wait for its own results)."""
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        run()
    pd = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    intervals, time_by, count_by = [], collections.Counter(), collections.Counter()
    for plane in pd.planes:
        for line in plane.lines if plane.name.startswith("/device:GPU") else ():
            for e in line.events if line.name.startswith("Stream") else ():
                intervals.append((int(e.start_ns), int(e.start_ns + e.duration_ns)))
                name = re.sub(r"_\d+$", "", e.name)[:60]
                time_by[name] += e.duration_ns
                count_by[name] += 1
    return intervals, time_by, count_by


def busy_and_gaps_ns(intervals: list[tuple[int, int]], large_ns: int = 10_000) -> tuple[int, int, int, int]:
    """(union of the kernel intervals, then of the idle time between them: the sum of gaps >= large_ns, their
    count, the sum of smaller gaps)."""
    busy = large = count = small = 0
    end = None
    for s, e in sorted(intervals):
        gap = 0 if end is None else s - end
        if gap >= large_ns:
            large, count = large + gap, count + 1
        elif gap > 0:
            small += gap
        busy += e - s if gap >= 0 else max(0, e - end)
        end = e if end is None else max(end, e)
    return busy, large, count, small


def profile_steps(step, weights, state, inp, steps: int):
    """Device busy time, idle gaps and the kernels that take the time, per decode step, from a profile."""
    intervals, time_by, count_by = device_profile(lambda: run_steps(step, weights, state, inp, steps))
    if not intervals:
        return None
    busy, large, count, small = busy_and_gaps_ns(intervals)
    kernel_time = sum(e - s for s, e in intervals)
    return {"busy_per_step_s": busy / steps / 1e9, "overlap_per_step_s": (kernel_time - busy) / steps / 1e9,
            "large_gaps_per_step_s": large / steps / 1e9, "large_gaps": count,
            "small_gaps_per_step_s": small / steps / 1e9, "kernels_per_step": len(intervals) / steps,
            "top": [(n, t / steps / 1e3, count_by[n] / steps) for n, t in time_by.most_common(24)]}


def run_variant(cfg, weights, batch: int, context: int, steps: tuple[int, ...], kv_dtype=jnp.bfloat16):
    """{steps timed: (wall seconds per step, profile)}: each count timed three times in turn (the median kept).
    A run of few steps includes the pipeline's fill and drain (the first launch, the last read back); a long
    one is the steady state of a long generation."""
    start = time.perf_counter()
    step, state, inp = decode_step(cfg, weights, batch, context, kv_dtype=kv_dtype)
    print(f"  batch {batch}: compiled and run once in {time.perf_counter() - start:.1f} s", flush=True)
    inp = jnp.asarray(inp)  # the packed inputs on the device: the step alone is timed
    times: dict[int, list[float]] = {n: [] for n in steps}
    for _ in range(3):
        for n in steps:
            seconds, state = run_steps(step, weights, state, inp, n)
            times[n].append(seconds)
    profile = profile_steps(step, weights, state, inp, steps[0])
    return {n: (float(np.median(t)), profile) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--variants", default="bfloat16,int8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", default="20,200",
                    help="steps per timing, comma-separated: 20 includes the pipeline's fill and drain (~3 ms on the "
                         "H100), 200 is the steady state of a 200-token generation")
    ap.add_argument("--out", default="benchmarks/results/decode_profile_gpu.jsonl")
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else LLAMA_8B
    out = "/tmp/decode_profile_smoke.jsonl" if args.smoke else args.out
    copy_bw = copy_bandwidth()
    print(f"{jax.devices()[0]} jax {jax.__version__}; device copy {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    bf16 = random_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    variants = {  # name: (weights, KV page dtype)
        "bfloat16": (lambda: bf16, jnp.bfloat16),
        "int8": (lambda: quantize_weights(bf16, QuantConfig(mode="int8"), jnp.bfloat16), jnp.bfloat16),
        "float8-kv": (lambda: bf16, jnp.float8_e4m3fn),
    }
    table = []
    for name in args.variants.split(","):
        make_weights, kv_dtype = variants[name]
        weights = make_weights()
        for batch in [int(b) for b in args.batches.split(",")]:
            floor = step_bytes(cfg, weights, batch, args.context, jnp.dtype(kv_dtype).itemsize) / copy_bw
            steps = tuple(int(n) for n in args.steps.split(","))
            for n, (wall, prof) in run_variant(cfg, weights, batch, args.context, steps, kv_dtype).items():
                config = {"model": "8B-shaped Llama, random weights" if not args.smoke else "smoke", "variant": name,
                          "weights": "int8" if name == "int8" else "bfloat16",
                          "kv_dtype": jnp.dtype(kv_dtype).name, "batch": batch, "context": args.context, "steps": n}
                record(out, "decode_step_vs_floor", config, "seconds_per_step", wall, "s", "bandwidth_floor", floor,
                       higher_is_better=False)
                line = (f"{name:9s} b{batch:<4d} {n:4d} steps {wall * 1e3:7.3f} ms/step  floor {floor * 1e3:6.3f} ms ="
                        f" {floor / wall:5.1%}")
                if prof:
                    record(out, "decode_device_busy", config, "busy_fraction", prof["busy_per_step_s"] / wall,
                           "fraction")
                    record(out, "decode_kernel_overlap", config, "overlap_per_step", prof["overlap_per_step_s"], "s")
                    line += (f"  busy {prof['busy_per_step_s'] * 1e3:.3f} ms ({prof['busy_per_step_s'] / wall:.1%})"
                             f"  {prof['kernels_per_step']:.0f} kernels/step; idle gaps >= 10 us:"
                             f" {prof['large_gaps_per_step_s'] * 1e6:.1f} us/step ({prof['large_gaps']}),"
                             f" smaller: {prof['small_gaps_per_step_s'] * 1e6:.1f} us/step;"
                             f" overlap {prof['overlap_per_step_s'] * 1e6:.1f} us/step")
                    print(line)
                    for kernel, us, count in prof["top"]:
                        print(f"    {us:9.1f} us  x{count:5.1f}  {kernel}")
                table.append(line)
        del weights
    print("\n".join(table))


if __name__ == "__main__":
    main()
