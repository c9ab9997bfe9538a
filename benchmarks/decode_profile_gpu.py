"""Where a decode step's time goes on the GPU: an 8B-shaped Llama through jaxserve's step function.

For each variant (bfloat16, int8) and batch, in one run:
- wall time per step, dispatching steps back to back as the engine does (no sync between steps), over
  20 steps (with the pipeline's fill and drain: the first launch, the last read back) and over 200
  (the steady state of a long generation);
- from a profile of the same steps: device busy time per step (the union of kernel intervals), idle
  gaps split by size, kernels per step, and the kernels that take the time, grouped by name
  (`--timeline FILE` writes every kernel's start, duration and name);
- the bandwidth floor: weight bytes plus the K/V bytes a step reads, over a device copy measured
  in the same run;
- the kernels' own time beyond the busy time (`overlap`: kernels running at once) and the streams they ran on;
  with `--compiles N`, all of it for N compiles of each step (identical kernels; the int8 step has moved by up to
  30 % between such compiles on one H100 while bfloat16 stayed put).

    PYTHONPATH=. python3 benchmarks/decode_profile_gpu.py [--batches 1,64] [--variants bfloat16,int8]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
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
    embed = weights.embed
    embed_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(embed))
    tied = weights.lm_head is None
    kv = 2 * cfg.num_layers * batch * (context + 1) * cfg.num_kv_heads * cfg.head_dim * kv_bytes
    return param_bytes(weights) - (0 if tied else embed_bytes) + kv


def device_intervals(path: str, timeline: str | None = None) -> tuple[list[tuple[int, int]], collections.Counter,
                                                                     collections.Counter]:
    """(kernel intervals, time per kernel name, count per kernel name) of the GPU plane of a profile; with
    `timeline`, every kernel's (start ns, duration ns, full name) is written there as JSON lines."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    intervals, time_by, count_by, events = [], collections.Counter(), collections.Counter(), []
    streams = set()
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not re.match(r"Stream", line.name):
                print(f"    (profile line {plane.name} / {line.name}: skipped)")
                continue
            for e in line.events:
                streams.add(line.name)
                intervals.append((int(e.start_ns), int(e.start_ns + e.duration_ns)))
                if timeline:
                    events.append((int(e.start_ns), int(e.duration_ns), e.name))
                name = re.sub(r"_\d+$", "", e.name)[:60]
                time_by[name] += e.duration_ns
                count_by[name] += 1
    if timeline:
        with open(timeline, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in sorted(events))
    if len(streams) > 1:
        print(f"    (kernels on {len(streams)} streams: {', '.join(sorted(streams))})")
    return intervals, time_by, count_by


def device_profile(run, timeline: str | None = None) -> tuple[list[tuple[int, int]], collections.Counter,
                                                              collections.Counter]:
    """device_intervals of a profile taken while `run()` runs (it must wait for its own results)."""
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        run()
    return device_intervals(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0], timeline)


def gaps_ns(intervals: list[tuple[int, int]], large_ns: int = 10_000) -> tuple[int, int, int]:
    """Idle time between the merged kernel intervals: (sum of gaps >= large_ns, their count, sum of smaller gaps)."""
    large = count = small = 0
    end = None
    for s, e in sorted(intervals):
        if end is not None and s > end:
            if s - end >= large_ns:
                large, count = large + s - end, count + 1
            else:
                small += s - end
        end = e if end is None else max(end, e)
    return large, count, small


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


def profile_steps(step, weights, state, inp, steps: int, timeline: str | None = None):
    """Device busy time, idle gaps and the kernels that take the time, per decode step, from a profile."""
    intervals, time_by, count_by = device_profile(lambda: run_steps(step, weights, state, inp, steps), timeline)
    if not intervals:
        return None
    busy, span = busy_ns(intervals)
    large, count, small = gaps_ns(intervals)
    kernel_time = sum(e - s for s, e in intervals)
    return {"busy_per_step_s": busy / steps / 1e9, "span_per_step_s": span / steps / 1e9,
            "overlap_per_step_s": (kernel_time - busy) / steps / 1e9,
            "large_gaps_per_step_s": large / steps / 1e9, "large_gaps": count,
            "small_gaps_per_step_s": small / steps / 1e9, "kernels_per_step": len(intervals) / steps,
            "top": [(n, t / steps / 1e3, count_by[n] / steps) for n, t in time_by.most_common(24)]}


def run_variant(cfg, weights, batch: int, context: int, steps: tuple[int, ...], timeline: str | None = None,
                kv_dtype=jnp.bfloat16):
    """{steps timed: (wall seconds per step, profile)}: each count timed three times in turn (the median kept).
    A run of few steps includes the pipeline's fill and drain (the first launch, the last read back); a long
    one is the steady state of a long generation."""
    start = time.perf_counter()
    step, state, inp = decode_step(cfg, weights, batch, context, kv_dtype=kv_dtype)
    print(f"  batch {batch}: compiled and run once in {time.perf_counter() - start:.1f} s", flush=True)
    inp = {name: jnp.asarray(x) for name, x in inp.items()}  # inputs on the device: the step alone is timed
    times: dict[int, list[float]] = {n: [] for n in steps}
    for _ in range(3):
        for n in steps:
            seconds, state = run_steps(step, weights, state, inp, n)
            times[n].append(seconds)
    profile = profile_steps(step, weights, state, inp, steps[0], timeline)
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
    ap.add_argument("--timeline", default=None, help="write every profiled kernel (start, duration, name) to this file")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (a quicker look)")
    ap.add_argument("--compiles", type=int, default=1, help="compile and profile each step this many times")
    ap.add_argument("--out", default="benchmarks/results/decode_profile_gpu.jsonl")
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else LLAMA_8B
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
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
            for compiled, n, (wall, prof) in [(c, n, r) for c in range(args.compiles) for n, r in run_variant(
                    cfg, weights, batch, args.context, steps, args.timeline, kv_dtype).items()]:
                model = "8B-shaped Llama, random weights" if not args.smoke else "smoke"
                config = {"model": model + (f", {cfg.num_layers} layers" if args.layers else ""), "variant": name,
                          "weights": "int8" if name == "int8" else "bfloat16",
                          "kv_dtype": jnp.dtype(kv_dtype).name, "batch": batch, "context": args.context, "steps": n}
                if args.compiles > 1:
                    config["compile"] = compiled
                record(out, "decode_step_vs_floor", config, "seconds_per_step", wall, "s", "bandwidth_floor", floor,
                       higher_is_better=False)
                line = (f"{name:9s} b{batch:<4d} {n:4d} steps {wall * 1e3:7.3f} ms/step  floor {floor * 1e3:6.3f} ms ="
                        f" {floor / wall:5.1%}" + (f"  (compile {compiled})" if args.compiles > 1 else ""))
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
                    for n, us, c in prof["top"]:
                        print(f"    {us:9.1f} us  x{c:5.1f}  {n}")
                table.append(line)
        del weights
    print("\n".join(table))


if __name__ == "__main__":
    main()
