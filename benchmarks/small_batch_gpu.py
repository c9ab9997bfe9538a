"""Where small-batch decode and a long prefill lose time on the GPU (issue 10), in one run.

1. The paged decode kernel at batch 1 and 8 for several sequence-split counts (those of the kernel's
   `default_splits` among them) against the rule it replaced (`two_waves`), each a time in microseconds.
2. The 8B decode step at batch 1 (jaxserve's step function) with the kernel's split rule and with the
   rule it replaced (`two_waves`), both compiled in this process and timed alternately.
3. (gemm) The 8B decode step at batch 1 with XLA's Triton GEMM fusions and with cuBLAS products, alternated.
4. A profile of the 8B prefill step of one --prefill-len prompt: wall time and the kernels that take it,
   beside its matrix-product floor at the bf16 rate measured here.

    PYTHONPATH=. python3 benchmarks/small_batch_gpu.py [--parts splits,step,gemm,prefill]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record, repeated, timed  # noqa: E402
from benchmarks.decode_profile_gpu import busy_ns, device_profile, profile_steps, step_bytes  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, PAGE_SIZE, compile_step, decode_step, run_steps  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth  # noqa: E402
from benchmarks.serving_gpu import matmul_rate, prefill_flops  # noqa: E402
from jaxserve.engine.batch import StepInput  # noqa: E402
from jaxserve.model.kv_cache import KVCache  # noqa: E402
from jaxserve.model.weights import random_weights  # noqa: E402
from jaxserve.step import DeviceState  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.paged_attention import mosaic_gpu as decode_gpu  # noqa: E402

OUT = "benchmarks/results/small_batch_gpu.jsonl"
GEMM_VARIANTS = os.environ.get("GEMM_VARIANTS", "default,cublas").split(",")


def splits_sweep(copy_bw: float, table: list[str]) -> None:
    heads, kv, hd, ps, reps = 32, 8, 128, PAGE_SIZE, 20
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        for ctx in (1504, 2048, 8192):
            pages = ctx // ps
            ks = jax.random.split(jax.random.PRNGKey(ctx + batch), 3)
            kp = jax.random.normal(ks[0], (kv, batch * pages, ps, hd), jnp.bfloat16)
            vp = jax.random.normal(ks[1], (kv, batch * pages, ps, hd), jnp.bfloat16)
            q = jax.random.normal(ks[2], (batch, heads, hd), jnp.bfloat16)
            table_ = jnp.asarray(testing.random_page_table(rng, batch, pages, batch * pages))
            lengths = jnp.full((batch,), ctx, jnp.int32)
            nbytes = 2 * batch * ctx * kv * hd * 2
            old = two_waves(batch, kv, ctx, 128)  # the rule this sweep replaced: its baseline
            expect = np.asarray(jax.jit(decode_gpu.paged_attention)(q, kp, vp, table_, lengths), np.float32)
            times = {}
            for splits in sorted({old, decode_gpu.default_splits(batch, kv, ctx, 128), 2, 4, 8, 12, 16, 24, 32}):
                if splits * 64 > ctx:
                    continue
                for bk in (64, 128):
                    if splits * bk > ctx:
                        continue
                    bs = decode_gpu.BlockSizes(block_k=bk, stages=2, num_splits=splits)
                    fn = lambda *a, bs=bs: decode_gpu.paged_attention(*a, block_sizes=bs)  # noqa: E731
                    out = np.asarray(jax.jit(fn)(q, kp, vp, table_, lengths), np.float32)
                    err = float(np.linalg.norm(out - expect) / np.linalg.norm(expect))
                    assert err < 2e-2, (batch, ctx, splits, bk, err)
                    times[(splits, bk)] = timed(repeated(fn, reps), q, kp, vp, table_, lengths, reps=5) / reps
            base = times[(old, 128)]
            best = min(times, key=times.get)
            for (splits, bk), t in sorted(times.items()):
                config = {"batch": batch, "context": ctx, "num_splits": splits, "block_k": bk, "two_wave_splits": old,
                          "rule_splits": decode_gpu.default_splits(batch, kv, ctx, 128), "timing": "20 calls in one jit"}
                record(OUT, "paged_decode_splits", config,
                       "time", t * 1e6, "us", "two-wave rule, block_k 128", base * 1e6, higher_is_better=False)
            table.append(f"decode b={batch} ctx={ctx}: two-wave rule {old} splits {base * 1e6:6.1f} us "
                         f"({nbytes / base / copy_bw:5.1%} of copy); best {best[0]} splits bk {best[1]} "
                         f"{times[best] * 1e6:6.1f} us ({nbytes / times[best] / copy_bw:5.1%})")
            print(table[-1], flush=True)


def whole_blocks(batch: int, kv_heads: int, max_len: int, block_k: int) -> int:
    """As many splits as one wave holds, counted in whole blocks so that none collapse in the rounding
    (12 of one block at batch 1 and 1,504 tokens, where the default asks 11 and gets 6)."""
    programs = batch * kv_heads
    if programs >= decode_gpu.NUM_SMS:
        return 1
    blocks = -(-max_len // block_k)
    return -(-blocks // -(-blocks // (decode_gpu.NUM_SMS // programs)))


def two_waves(batch: int, kv_heads: int, max_len: int, block_k: int) -> int:
    """The split rule before 2026-11-24: two waves of programs, at least four blocks a split."""
    programs = batch * kv_heads
    return 1 if programs >= decode_gpu.NUM_SMS else max(1, min(-(-2 * decode_gpu.NUM_SMS // programs),
                                                                max_len // (4 * block_k)))


def alternate(built: dict, weights, rounds: int = 5, steps: int = 20) -> dict[str, list[float]]:
    """Seconds per step of each built (step, state, inputs), `steps` back to back, the variants taking turns
    for `rounds` rounds (so drifts of clock or temperature fall on all of them); `built` keeps the last state."""
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(rounds):
        for name, (step, state, inp) in built.items():
            seconds, state = run_steps(step, weights, state, inp, steps)
            built[name] = (step, state, inp)
            times[name].append(seconds)
    return times


def report_ab(benchmark: str, key: str, built: dict, weights, copy_bw: float, context: int, table: list[str],
              base_name: str = "default") -> None:
    """Times the built batch-1 steps alternately (100 steps a turn), profiles each, and records each against
    `base_name` (the first variant, if that one did not build) under `benchmark`, the variant named by `key`."""
    times = alternate(built, weights, steps=100)
    floor = step_bytes(LLAMA_8B, weights, 1, context) / copy_bw
    base_name = base_name if base_name in times else next(iter(times))
    base = float(np.median(times[base_name]))
    for name, ts in times.items():
        step, state, inp = built[name]
        prof = profile_steps(step, weights, state, inp, 20)
        attention_us = sum(us for n, us, _ in prof["top"] if "mosaic" in n)
        t = float(np.median(ts))
        record(OUT, benchmark, {"batch": 1, "context": context, key: name, "runs_s": ts,
                                "busy_s": prof["busy_per_step_s"], "attention_kernel_us": attention_us,
                                "top": prof["top"][:4], "floor_s": floor},
               "seconds_per_step", t, "s", base_name, base, higher_is_better=False)
        table.append(f"step b=1 ctx={context} {name:8s} {t * 1e3:7.3f} ms = {floor / t:5.1%} of floor "
                     f"({base / t:5.3f}x {base_name}), busy {prof['busy_per_step_s'] * 1e3:.3f} ms, attention "
                     f"{attention_us:.0f} us; top: " + "; ".join(f"{n} {us:.0f} us x{c:.0f}" for n, us, c in prof["top"][:3]))
        print(table[-1], flush=True)


def step_ab(weights, copy_bw: float, context: int, table: list[str]) -> None:
    """Batch-1 decode step with the kernel's split rule and with `whole_blocks` (tried, not kept)."""
    original = decode_gpu.default_splits
    built = {}
    for name, rule in {"default": original, "whole_blocks": whole_blocks}.items():
        decode_gpu.default_splits = rule
        try:
            built[name] = decode_step(LLAMA_8B, weights, 1, context)
        finally:
            decode_gpu.default_splits = original
    report_ab("decode_step_splits_ab", "rule", built, weights, copy_bw, context, table)


def gemm_ab(weights, copy_bw: float, context: int, table: list[str]) -> None:
    """Batch-1 decode step compiled with XLA's defaults (Triton GEMM fusions) and with other compiler options
    (env GEMM_VARIANTS picks among them): cuBLAS for every product, every fusion through Triton's block-level
    emitter, Triton's heroless priority fusion, no CUDA graphs, CUDA graphs of any size, or the autotuner's
    exhaustive search over GEMM tilings."""
    variants = {"default": {}, "cublas": {"xla_gpu_enable_triton_gemm": False},
                "block_level": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
                "heroless": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
                "graphs_off": {"xla_gpu_enable_command_buffer": ""},
                "graphs_min1": {"xla_gpu_graph_min_graph_size": 1},
                "exhaustive": {"xla_gpu_exhaustive_tiling_search": True}}
    built = {}
    for name, options in variants.items():
        if name not in GEMM_VARIANTS:
            continue
        start = time.perf_counter()
        try:
            built[name] = decode_step(LLAMA_8B, weights, 1, context, options)
        except Exception as e:  # an option this XLA does not know, or cannot compile with
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"  {name}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
    report_ab("decode_step_gemm_ab", "gemms", built, weights, copy_bw, context, table)


def prefill_profile(weights, length: int, table: list[str]) -> None:
    cfg = LLAMA_8B
    pages = -(-(length + 1) // PAGE_SIZE)
    state = DeviceState(KVCache.zeros(cfg, pages, PAGE_SIZE, jnp.bfloat16, padding_page=True),
                        jnp.zeros(1, jnp.int32))
    inp = vars(StepInput.build([None], length, pages, 1))
    inp["tokens"][0] = np.random.default_rng(0).integers(0, cfg.vocab_size, length)
    inp["positions"][0] = np.arange(length)
    inp["valid"][0] = True
    inp["page_table"][0] = np.arange(pages)
    inp["last"][0] = length - 1
    inp["slots"][0] = 0
    inp = {k: jnp.asarray(v) for k, v in inp.items()}
    start = time.perf_counter()
    step = compile_step(cfg, weights, state, inp)
    print(f"  prefill {length}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        packed, _, state = step(weights, state, inp)
        jax.block_until_ready(packed)
        times.append(time.perf_counter() - t0)
    wall = float(np.median(times[2:]))
    intervals, time_by, count_by = device_profile(lambda: jax.block_until_ready(step(weights, state, inp)[0]))
    busy, _ = busy_ns(intervals)
    floor = prefill_flops(cfg, length) / matmul_rate(jnp.bfloat16)
    record(OUT, "prefill_step_vs_floor", {"prompt_len": length, "busy_s": busy / 1e9,
                                          "top": [(n, t / 1e3, count_by[n]) for n, t in time_by.most_common(12)]},
           "seconds", wall, "s", "compute_floor", floor, higher_is_better=False)
    table.append(f"prefill {length}: {wall * 1e3:.1f} ms, busy {busy / 1e6:.1f} ms, floor {floor * 1e3:.1f} ms "
                 f"({wall / floor:.2f}x)")
    for n, t in time_by.most_common(12):
        table.append(f"    {t / 1e3:9.1f} us  x{count_by[n]:4d}  {n}")
    print("\n".join(table[-13:]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="splits,step,prefill")
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--prefill-len", type=int, default=2000)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    copy_bw = copy_bandwidth()
    print(f"{jax.devices()[0]} jax {jax.__version__}; device copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    table: list[str] = []
    if "splits" in parts:
        splits_sweep(copy_bw, table)
    weights = random_weights(LLAMA_8B, jax.random.PRNGKey(0), jnp.bfloat16) if parts & {"step", "gemm", "prefill"} else None
    if "step" in parts:
        step_ab(weights, copy_bw, args.context, table)
    if "gemm" in parts:
        gemm_ab(weights, copy_bw, args.context, table)
    if "prefill" in parts:
        prefill_profile(weights, args.prefill_len, table)
    print("\n".join(table))


if __name__ == "__main__":
    main()
