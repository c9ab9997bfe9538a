"""Attention kernels on a Hopper GPU: flash vs cuDNN and XLA, paged decode vs a device copy and the reference.

    PYTHONPATH=. python3 benchmarks/kernels_gpu.py [--only flash|decode] [--out benchmarks/results/kernels_gpu.jsonl]

Every figure is a ratio against a baseline timed in the same run; the table prints last.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record, repeated, timed  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.flash_attention import mosaic_gpu as flash_gpu  # noqa: E402
from pallas_kernels.paged_attention import mosaic_gpu as decode_gpu  # noqa: E402
from pallas_kernels.paged_attention import reference as decode_ref  # noqa: E402


def copy_bandwidth(profiled: bool = False) -> float:
    """Bytes/s of a 1 GiB device copy (read + write), timed from the host or, `profiled`, from its kernel's own
    time in a profile (no launch or host time)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (512 * 1024 * 1024,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    if not profiled:
        return 2 * x.nbytes / timed(f, x, inner=10)
    jax.block_until_ready(f(x))
    seconds, count = kernel_seconds(lambda: [jax.block_until_ready(f(x)) for _ in range(10)], "")
    return 2 * x.nbytes * count / seconds if seconds else float("nan")


def kernel_seconds(run, match: str) -> tuple[float, int]:
    """(total device seconds, count) of the kernels whose name contains `match`, in a profile of `run()`."""
    from benchmarks.decode_profile_gpu import device_profile

    _, time_by, count_by = device_profile(run)
    names = [n for n in time_by if match in n]
    return sum(time_by[n] for n in names) / 1e9, sum(count_by[n] for n in names)


def flash_problem(seq: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v [batch, seq, 16 heads, 128] bfloat16, batch · seq = 16k tokens: the flash benchmarks' shapes."""
    ks = jax.random.split(jax.random.PRNGKey(seq), 3)
    return tuple(jax.random.normal(kk, (16384 // seq, seq, 16, 128), jnp.bfloat16) for kk in ks)


def flash_flops(q: jax.Array, causal: bool) -> float:
    b, seq, heads, hd = q.shape
    return 4 * b * heads * seq * seq * hd * (0.5 if causal else 1.0)


def cudnn_attention(causal: bool):
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))


def placed_copies(arrays: tuple[jax.Array, ...], count: int) -> list[tuple[jax.Array, ...]]:
    """`count` copies of the same arrays at different device addresses: spacer buffers of growing size between
    them shift where the allocator puts each copy. The first is the arrays themselves."""
    copies, spacers = [arrays], []
    for i in range(1, count):
        spacers.append(jnp.zeros((i * ((1 << 20) + 4096 * i),), jnp.uint8) + 1)  # alive while the copies are made
        copies.append(tuple(x + 0 for x in arrays))
    jax.block_until_ready((copies, spacers))
    return copies


def rates_over_placements(fns: dict, copies: list[tuple[jax.Array, ...]], flops: float, rounds: int
                          ) -> list[dict[str, float]]:
    """TFLOP/s of each function at each placement: the best of `rounds` timings, the functions alternated at each
    placement, the placements visited in a rotated order each round (so that no one is always timed first, after
    the compile's idle gap)."""
    best = [{name: float("inf") for name in fns} for _ in copies]
    for r in range(rounds):
        for i in range(len(copies)):
            at = (i + r) % len(copies)
            for name, fn in fns.items():
                best[at][name] = min(best[at][name], timed(fn, *copies[at], inner=10))
    return [{name: flops / t / 1e12 for name, t in times.items()} for times in best]


def bench_flash(path: str, rows: list, seqs: tuple[int, ...] = (2048, 4096, 8192, 16384),
                placements: int = 5, rounds: int = 3) -> None:
    """Ours (default block sizes) against cuDNN, alternated, over the same q, k, v at `placements` addresses.

    Both kernels' rates move by up to 10 % from one copy of the inputs to another, so one copy can make either
    look faster. Each placement gives one ratio (best of `rounds` alternated timings of each); the row gives the
    placement with the median ratio (upper middle for an even count), every placement's figures and address in
    its config.
    """
    for seq in seqs:
        problem = flash_problem(seq)
        q = problem[0]
        b, _, heads, hd = q.shape
        copies = placed_copies(problem, placements)
        for causal in (True, False):
            flops = flash_flops(q, causal)
            cudnn = cudnn_attention(causal)
            ours = jax.jit(lambda q, k, v, c=causal: flash_gpu.flash_attention(q, k, v, causal=c))
            rates = rates_over_placements({"ours": ours, "cudnn": cudnn}, copies, flops, rounds)
            ratios = [r["ours"] / r["cudnn"] for r in rates]  # in placement order
            median = sorted(rates, key=lambda r: r["ours"] / r["cudnn"])[len(rates) // 2]
            tf_ours, tf_cudnn = median["ours"], median["cudnn"]
            err = testing.relative_error(ours(*problem), np.asarray(cudnn(*problem), np.float64))
            bs = flash_gpu.default_block_sizes(heads // problem[1].shape[2], seq, hd)
            config = dict(batch=b, seq=seq, heads=heads, head_dim=hd, causal=causal, dtype="bfloat16", err_vs_cudnn=err,
                          block_k=bs.block_k, stages=bs.stages, heads_per_program=bs.heads_per_program,
                          placements=placements, rounds=rounds,
                          ratios=[round(r, 4) for r in ratios],
                          placement_tflops=[{name: round(t, 1) for name, t in r.items()} for r in rates],
                          k_addresses=[hex(arrays[1].unsafe_buffer_pointer()) for arrays in copies])
            record(path, "flash_attention", config, "throughput", tf_ours, "TFLOP/s", "cudnn", tf_cudnn)
            xla = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                                                implementation="xla"))
            try:
                xla_tf = flops / timed(xla, *problem, reps=3, inner=2) / 1e12
                record(path, "flash_attention", config, "throughput", tf_ours, "TFLOP/s", "xla", xla_tf)
            except Exception as e:  # noqa: BLE001  (XLA's scores matrix can exceed memory)
                xla_tf = float("nan")
                print("xla failed:", type(e).__name__, str(e)[:200])
            line = (f"flash s={seq:5d} causal={causal!s:5} ours {tf_ours:6.1f} cudnn {tf_cudnn:6.1f} xla {xla_tf:6.1f} "
                    f"TFLOP/s  ours/cudnn {tf_ours / tf_cudnn:5.3f} (median of {placements} placements; "
                    f"{min(ratios):5.3f}-{max(ratios):5.3f})  err {err:.1e}")
            print(line, flush=True)
            rows.append(line)
        del copies


def bench_decode(path: str, rows: list, copy_bw: float, copy_bw_device: float,
                 batches: tuple[int, ...] = (1, 8, 32, 128), contexts: tuple[int, ...] = (512, 2048, 8192, 32768),
                 kv_dtype: str = "bfloat16") -> None:
    """Each shape runs the default tiling (num_splits chosen by `default_splits`) and fixed alternatives, the best
    also profiled. kv_dtype float8_e4m3fn: 8-bit pages, converted inside the kernel; bytes are counted at their size."""
    heads, kv, hd, ps = 32, 8, 128, 16
    configs = [decode_gpu.BlockSizes(block_k=bk, stages=st, num_splits=sp, slots_per_program=sl) for bk, st, sp, sl in
               ((64, 2, None, None), (64, 4, None, None), (128, 2, None, None), (64, 3, None, None), (64, 3, 2, None),
                (128, 2, 2, None), (128, 2, None, 1), (64, 3, None, 1))]
    reps = 20
    rng = np.random.default_rng(0)
    for batch in batches:
        for ctx in contexts:
            pages = ctx // ps
            num_pages = batch * pages
            ks = jax.random.split(jax.random.PRNGKey(batch * ctx), 3)
            kp = jax.random.normal(ks[0], (kv, num_pages, ps, hd), jnp.bfloat16).astype(kv_dtype)
            vp = jax.random.normal(ks[1], (kv, num_pages, ps, hd), jnp.bfloat16).astype(kv_dtype)
            q = jax.random.normal(ks[2], (batch, heads, hd), jnp.bfloat16)
            table = jnp.asarray(testing.random_page_table(rng, batch, pages, num_pages))
            lengths = jnp.full((batch,), ctx, jnp.int32)
            nbytes = 2 * batch * ctx * kv * hd * jnp.dtype(kv_dtype).itemsize
            small = nbytes <= (4 << 30)
            expect = jax.jit(decode_ref.paged_attention)(q, kp, vp, table, lengths) if small else None
            best = None
            for bs in configs:
                fn = jax.jit(lambda *a, bs=bs: decode_gpu.paged_attention(*a, block_sizes=bs))
                try:
                    out = fn(q, kp, vp, table, lengths)
                    err = testing.relative_error(out, np.asarray(expect, np.float64)) if small else float("nan")
                    t = timed(repeated(lambda *a, bs=bs: decode_gpu.paged_attention(*a, block_sizes=bs), reps),
                              q, kp, vp, table, lengths, reps=5, inner=1) / reps
                except Exception as e:  # noqa: BLE001
                    print("decode failed", batch, ctx, bs, type(e).__name__, str(e)[:300])
                    continue
                bw = nbytes / t
                config = dict(timing="20 calls in one jit", batch=batch, context=ctx, heads=heads, kv_heads=kv,
                              head_dim=hd, page_size=ps,
                              block_k=bs.block_k, stages=bs.stages, num_splits=bs.num_splits or "default",
                              slots_per_program=bs.slots_per_program or "default",
                              dtype="bfloat16", kv_dtype=kv_dtype, err_vs_reference=err)
                record(path, "paged_decode", config, "kv_bandwidth", bw / 1e12, "TB/s", "device_copy", copy_bw / 1e12)
                if best is None or t < best[0]:
                    best = (t, bs, err, config)
            if best is None:
                continue
            t, bs, err, config = best
            # The same calls profiled: the kernel's own device time, without the chaining op `repeated` adds between
            # calls (and the combine, where the sequence is split, which is its own kernel), against the copy's.
            chained = repeated(lambda *a, bs=bs: decode_gpu.paged_attention(*a, block_sizes=bs), reps)
            jax.block_until_ready(chained(q, kp, vp, table, lengths))
            args = (q, kp, vp, table, lengths)
            seconds, count = kernel_seconds(lambda f=chained, a=args: jax.block_until_ready(f(*a)), "mosaic")
            t_kernel = seconds / count if count else float("nan")  # no GPU plane in the profile: no kernel time
            record(path, "paged_decode", {**config, "timing": "kernel device time (profile)", "kernels": count},
                   "kv_bandwidth", nbytes / t_kernel / 1e12, "TB/s", "device_copy (kernel device time)",
                   copy_bw_device / 1e12)
            t_ref = (timed(repeated(decode_ref.paged_attention, reps), q, kp, vp, table, lengths, reps=3, inner=1) / reps
                     if small else float("nan"))
            if small:
                record(path, "paged_decode", config, "time", t * 1e6, "us", "reference", t_ref * 1e6,
                       higher_is_better=False)
            rows.append(f"decode {kv_dtype} b={batch:3d} ctx={ctx:5d} best bk={bs.block_k} st={bs.stages} "
                        f"splits={bs.num_splits or 'default'} slots={bs.slots_per_program or 'default'} {t * 1e6:8.1f} us "
                        f"{nbytes / t / 1e12:5.2f} TB/s = {nbytes / t / copy_bw:5.1%} of copy; kernel alone "
                        f"{t_kernel * 1e6:8.1f} us = {nbytes / t_kernel / copy_bw_device:5.1%} of the copy kernel  "
                        f"x{t_ref / t:6.1f} vs reference  err {err:.1e}")
            del kp, vp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/kernels_gpu.jsonl")
    parser.add_argument("--only", choices=("flash", "decode"))
    parser.add_argument("--batches", default="1,8,32,128", help="decode batch sizes")
    parser.add_argument("--seqs", default="2048,4096,8192,16384", help="flash sequence lengths")
    parser.add_argument("--placements", type=int, default=5, help="flash: addresses the same q, k, v are copied to "
                        "(odd: the row is the median placement)")
    parser.add_argument("--contexts", default="512,2048,8192,32768", help="decode context lengths")
    parser.add_argument("--kv-dtypes", default="bfloat16", help="decode page dtypes, e.g. bfloat16,float8_e4m3fn")
    args = parser.parse_args()
    if args.placements < 1:
        parser.error(f"--placements must be at least 1, got {args.placements}")
    print(jax.devices(), jax.__version__, flush=True)
    rows: list[str] = []
    copy_bw, copy_bw_device = copy_bandwidth(), copy_bandwidth(profiled=True)
    rows.append(f"device copy {copy_bw / 1e12:.2f} TB/s (read + write); its kernel alone {copy_bw_device / 1e12:.2f} TB/s")
    seqs, batches, contexts = (tuple(map(int, x.split(","))) for x in (args.seqs, args.batches, args.contexts))
    parts = {"flash": lambda: bench_flash(args.out, rows, seqs, args.placements),
             "decode": lambda: [bench_decode(args.out, rows, copy_bw, copy_bw_device, batches, contexts, kv_dtype)
                                for kv_dtype in args.kv_dtypes.split(",")]}
    for name, fn in parts.items():
        if args.only in (None, name):
            try:
                fn()
            except Exception:  # noqa: BLE001  (print the table of whatever finished)
                traceback.print_exc()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
