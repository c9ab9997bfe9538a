"""Where a decode step's time goes on the GPU: an 8B-shaped Llama through jaxserve's step function.

For each variant (bfloat16, int8) and batch, in one run:
- wall time per step, dispatching steps back to back as the engine does (no sync between steps);
- from a profile of the same steps: device busy time per step (the union of kernel intervals),
  kernels per step, and the kernels that take the time, grouped by name;
- the bandwidth floor: weight bytes plus the K/V bytes a step reads, over a device copy measured
  in the same run.

    PYTHONPATH=. python3 benchmarks/decode_profile_gpu.py [--batches 1,64] [--variants bfloat16,int8]
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


def step_bytes(cfg, weights, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row of it), plus K and V."""
    embed = weights.embed
    embed_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(embed))
    tied = weights.lm_head is None
    kv = 2 * cfg.num_layers * batch * (context + 1) * cfg.num_kv_heads * cfg.head_dim * 2
    return param_bytes(weights) - (0 if tied else embed_bytes) + kv


def device_intervals(path: str) -> tuple[list[tuple[int, int]], collections.Counter, collections.Counter]:
    """(kernel intervals, time per kernel name, count per kernel name) of the GPU plane of a profile."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    intervals, time_by, count_by = [], collections.Counter(), collections.Counter()
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not re.match(r"Stream", line.name):
                print(f"    (profile line {plane.name} / {line.name}: skipped)")
                continue
            for e in line.events:
                intervals.append((int(e.start_ns), int(e.start_ns + e.duration_ns)))
                name = re.sub(r"_\d+$", "", e.name)[:60]
                time_by[name] += e.duration_ns
                count_by[name] += 1
    return intervals, time_by, count_by


def device_profile(run) -> tuple[list[tuple[int, int]], collections.Counter, collections.Counter]:
    """device_intervals of a profile taken while `run()` runs (it must wait for its own results)."""
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        run()
    return device_intervals(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])


def busy_ns(intervals: list[tuple[int, int]]) -> tuple[int, int]:
    """(union of the intervals, span from the first start to the last end)."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0


def run_variant(cfg, weights, batch: int, context: int, steps: int, profile: bool):
    start = time.perf_counter()
    step, state, inp = decode_step(cfg, weights, batch, context)
    print(f"  batch {batch}: compiled and run once in {time.perf_counter() - start:.1f} s", flush=True)
    inp = {name: jnp.asarray(x) for name, x in inp.items()}  # inputs on the device: the step alone is timed
    times = []
    for _ in range(3):
        seconds, state = run_steps(step, weights, state, inp, steps)
        times.append(seconds)
    wall = float(np.median(times))
    prof = None
    if profile:
        intervals, time_by, count_by = device_profile(lambda: run_steps(step, weights, state, inp, steps))
        if intervals:
            busy, span = busy_ns(intervals)
            prof = {"busy_per_step_s": busy / steps / 1e9, "span_per_step_s": span / steps / 1e9,
                    "kernels_per_step": len(intervals) / steps,
                    "top": [(n, t / steps / 1e3, count_by[n] / steps) for n, t in time_by.most_common(14)]}
    return wall, prof


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--variants", default="bfloat16,int8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/decode_profile_gpu.jsonl")
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else LLAMA_8B
    out = "/tmp/decode_profile_smoke.jsonl" if args.smoke else args.out
    copy_bw = copy_bandwidth()
    print(f"{jax.devices()[0]} jax {jax.__version__}; device copy {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    bf16 = random_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    variants = {"bfloat16": lambda: bf16, "int8": lambda: quantize_weights(bf16, QuantConfig(mode="int8"), jnp.bfloat16)}
    table = []
    for name in args.variants.split(","):
        weights = variants[name]()
        for batch in [int(b) for b in args.batches.split(",")]:
            wall, prof = run_variant(cfg, weights, batch, args.context, args.steps, profile=True)
            nbytes = step_bytes(cfg, weights, batch, args.context)
            floor = nbytes / copy_bw
            config = {"model": "8B-shaped Llama, random weights" if not args.smoke else "smoke", "weights": name,
                      "batch": batch, "context": args.context, "steps": args.steps}
            record(out, "decode_step_vs_floor", config, "seconds_per_step", wall, "s", "bandwidth_floor", floor,
                   higher_is_better=False)
            line = f"{name:9s} b{batch:<4d} {wall * 1e3:7.3f} ms/step  floor {floor * 1e3:6.3f} ms = {floor / wall:5.1%}"
            if prof:
                record(out, "decode_device_busy", config, "busy_fraction", prof["busy_per_step_s"] / wall, "fraction")
                line += (f"  busy {prof['busy_per_step_s'] * 1e3:.3f} ms ({prof['busy_per_step_s'] / wall:.1%} of wall)"
                         f"  {prof['kernels_per_step']:.0f} kernels/step")
                print(line)
                for n, us, c in prof["top"]:
                    print(f"    {us:9.1f} us  x{c:5.1f}  {n}")
            table.append(line)
        del weights
    print("\n".join(table))


if __name__ == "__main__":
    main()
