"""int8 weights on a Hopper GPU: an 8B-shaped Llama decoding in bfloat16 and in int8, in one run.

1. The quantized-matmul kernel (Mosaic GPU) against float64 truth and the XLA path, on the 8B
   layer shapes at 1, 8 and 64 rows, with kernel-only timings (device time, no dispatch).
2. Decode steps through jaxserve's own step function (`jaxserve.step.step_fn`: forward over the
   paged KV cache, then sampling), compiled as the engine compiles it, for batch 1 and 64, timed
   alternated: bfloat16 weights, int8 weights (the Pallas kernel where it applies: backend "auto"),
   int8 through XLA (backend "reference") and, with `int8_megakernel`, the engine's decode_megakernel
   step (`stacked_step_fn`: every layer in one kernel, batch 1), whose logits are checked against the
   int8 step's. Ratios are against bfloat16 measured in the same run.

Random weights are generated on the device (nothing large travels). Usage:

    PYTHONPATH=. python3 benchmarks/int8_gpu.py             # H100: writes benchmarks/results/int8_gpu.jsonl
    PYTHONPATH=. python3 benchmarks/int8_gpu.py --skip-kernel --batches 1 --steps 50 --variants bfloat16,int8,int8_megakernel
        # the megakernel's step: 16-position pages by default, `--page-size 128` as configs/serve-int8-latency.yaml
    PYTHONPATH=. python3 benchmarks/int8_gpu.py --smoke     # a tiny config on CPU (kernels interpreted)

Each decode variant compiles the whole 32-layer step once per batch size; where one command has a
time limit, split the run: `--batches ""` (kernel part only), then `--skip-kernel --batches 1` and
`--skip-kernel --batches 64` (rows append to the same results file).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ClockLog, decode_input, print_rows, record, repeated, timed  # noqa: E402
from jaxserve.checkpoint.random_model import PRESETS  # noqa: E402
from jaxserve.config import EngineConfig, QuantConfig  # noqa: E402
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import KVCache  # noqa: E402
from jaxserve.model.quant import linear_bytes, quantize_weights, with_backend  # noqa: E402
from jaxserve.model.weights import param_bytes, random_weights  # noqa: E402
from jaxserve.step import DeviceState, pack_step_input, stacked_step_fn, step_fn, unpack_step_input  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.decode_megakernel import stack_layers, stack_pages  # noqa: E402
from pallas_kernels.decode_megakernel.mosaic_gpu import layer_products  # noqa: E402
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu  # noqa: E402
from pallas_kernels.quantized_matmul import reference as qmm_ref  # noqa: E402

LLAMA_8B = PRESETS["llama3-8b"]
SMOKE = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=64, max_position_embeddings=1024)
PAGE_SIZE = EngineConfig.page_size  # the engine's default
KEYS = ("layer", "m", "group", "batch", "weights", "error")  # of a row's config, printed in the table


def decode_step(cfg: ModelConfig, weights, batch: int, context: int, kv_dtype=jnp.bfloat16,
                page_size: int = PAGE_SIZE):
    """(compiled step, state, inputs) of a decode step of `batch` rows, each `context` tokens in, compiled as the
    engine compiles its buckets (the state donated; the inputs one packed array, unpacked on the device), run once.
    Weights given as (weights, stacked layers): the engine's decode_megakernel step (stacked_step_fn)."""
    pages = -(-(context + 1) // page_size)
    cache = KVCache.zeros(cfg, batch * pages, page_size, kv_dtype, padding_page=True)  # as the engine's
    fn = functools.partial(step_fn, cfg=cfg)
    if isinstance(weights, tuple):  # decode_megakernel: the pages stacked, as the engine holds them then
        cache = (stack_pages(cache.k), stack_pages(cache.v))
        fn = functools.partial(stacked_step_fn, cfg=cfg, attention="auto", page_size=page_size)
    state = DeviceState.zeros(cache, batch, cfg.vocab_size)
    inp = pack_step_input(decode_input(batch, context, pages, cfg.vocab_size))
    step = jax.jit(lambda w, st, packed: fn(w, st, unpack_step_input(packed, 1, pages)),
                   donate_argnums=(1,)).lower(weights, state, inp).compile()
    packed, _, _, state = step(weights, state, inp)
    jax.block_until_ready(packed)
    return step, state, inp


def run_steps(step, weights, state, inp, steps: int):
    """(seconds per step, state) of `steps` steps dispatched back to back, as the engine does."""
    t0 = time.perf_counter()
    for _ in range(steps):
        packed, _, _, state = step(weights, state, inp)
    jax.block_until_ready(packed)
    return (time.perf_counter() - t0) / steps, state


def kernel_checks(cfg: ModelConfig, out: str, smoke: bool) -> list[dict]:
    """The Mosaic GPU kernel against float64 truth on the model's layer shapes, then timed against XLA."""
    rows = []
    shapes = {"wo": layer_products(cfg)["wo"]} if smoke else layer_products(cfg)  # smoke: interpreted, one shape
    key = jax.random.PRNGKey(1)
    for name, (n, k) in shapes.items():
        values = jax.random.randint(key, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
        for group in (k, 128):
            scales = jax.random.uniform(key, (k // group, n), jnp.float32, 0.5, 2.0) / 127
            for m in (1, 8) if smoke else (1, 8, 64):
                x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
                cfg_row = {"layer": name, "n": n, "k": k, "m": m, "group": group}
                try:
                    got = jax.jit(qmm_gpu.quantized_matmul)(x, values, scales)
                    w = np.asarray(values, np.float64).reshape(n, k // group, group)
                    w = w * np.asarray(scales, np.float64).T[:, :, None]
                    truth = np.asarray(x.astype(jnp.float32), np.float64) @ w.reshape(n, k).T
                    err = testing.relative_error(got, truth)
                    ok = err < testing.tolerance("mosaic_gpu", "bfloat16")
                    rows.append(record(out, "int8_matmul_error", {**cfg_row, "ok": bool(ok)}, "relative_l2_error", err, "1"))
                    if smoke or group != k:
                        continue
                    inner = 20
                    w_bf16 = (values.astype(jnp.float32) * scales[0][:, None]).astype(jnp.bfloat16)
                    t_kernel = timed(repeated(qmm_gpu.quantized_matmul, inner), x, values, scales) / inner
                    t_xla = timed(repeated(qmm_ref.quantized_matmul, inner), x, values, scales) / inner
                    t_bf16 = timed(repeated(lambda a, b: jnp.dot(a, b.T), inner), x, w_bf16) / inner
                    for label, t in (("mosaic_gpu", t_kernel), ("xla_int8", t_xla)):
                        rows.append(record(out, f"int8_matmul_time_{label}", cfg_row, "us", t * 1e6, "us",
                                           "xla bfloat16 dot", t_bf16 * 1e6, higher_is_better=False))
                    rows.append(record(out, "int8_matmul_bandwidth_mosaic_gpu", cfg_row, "GB/s", n * k / t_kernel / 1e9,
                                       "GB/s"))
                except Exception as e:  # one failing shape must not hide the others' figures
                    traceback.print_exc()
                    rows.append(record(out, "int8_matmul_error", {**cfg_row, "error": f"{type(e).__name__}: {e}"[:500]},
                                       "relative_l2_error", float("nan"), "1"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny config, few steps: checks the script on CPU")
    ap.add_argument("--context", type=int, default=256, help="tokens already in each slot's KV cache")
    ap.add_argument("--page-size", type=int, default=PAGE_SIZE,
                    help=f"positions a KV page (default {PAGE_SIZE}, the engine's)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timing")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--variants", default="bfloat16,int8,int8_xla",
                    help="weights to time: bfloat16, int8 (kernel where it applies), int8_xla, int8_megakernel (batch "
                         "1: the engine's decode_megakernel step)")
    ap.add_argument("--skip-kernel", action="store_true", help="skip the kernel checks and timings (part 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else LLAMA_8B
    if args.smoke:
        args.steps, args.reps, args.context = 2, 1, 40
    out = args.out or ("/tmp/int8_gpu_smoke.jsonl" if args.smoke else "benchmarks/results/int8_gpu.jsonl")
    model = "8B-shaped Llama, random weights" if not args.smoke else "smoke config"
    base = {"model": model, "context": args.context, "steps": args.steps}
    if args.page_size != PAGE_SIZE:
        base["page_size"] = args.page_size
    print(f"{jax.devices()[0]} jax {jax.__version__}; writing {out}", flush=True)

    rows = [] if args.skip_kernel else kernel_checks(cfg, out, args.smoke)

    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches:
        return print_rows(rows, KEYS)
    bf16 = random_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    int8 = quantize_weights(bf16, QuantConfig(mode="int8"), jnp.bfloat16)
    rows.append(record(out, "int8_param_bytes", base, "parameter_bytes", param_bytes(int8), "bytes", "bfloat16",
                       param_bytes(bf16), higher_is_better=False))
    rows.append(record(out, "int8_linear_bytes", base, "linear_layer_bytes", linear_bytes(int8), "bytes", "bfloat16",
                       linear_bytes(bf16), higher_is_better=False))
    named = {"bfloat16": bf16, "int8": int8, "int8_xla": with_backend(int8, "reference")}
    if "int8_megakernel" in args.variants.split(","):  # the engine's decode_megakernel (one row): layers stacked
        named["int8_megakernel"] = (int8, stack_layers(cfg, int8.layers))
    variants = {name: named[name] for name in args.variants.split(",")}
    for batch in batches:
        steps = {}  # every variant compiled first, then their timings alternate (a slow spell hits them all)
        for name, weights in variants.items():
            try:
                steps[name] = decode_step(cfg, weights, batch, args.context, page_size=args.page_size)
            except Exception as e:  # the other variants still run; the failure is kept with the results
                traceback.print_exc()
                rows.append(record(out, "int8_decode_error", {**base, "batch": batch, "weights": name,
                                                              "error": f"{type(e).__name__}: {e}"[:500]},
                                   "compiled", 0.0, "1"))
        times = {name: [] for name in steps}
        with ClockLog() as clocks:  # the SM clock while the timings run (int8's products move with it)
            for _ in range(args.reps):
                for name, (step, state, inp) in steps.items():
                    t, state = run_steps(step, variants[name], state, inp, args.steps)
                    steps[name] = (step, state, inp)
                    times[name].append(t)
        seconds = {name: float(np.median(t)) for name, t in times.items()}
        for name, t in seconds.items():
            print(f"batch {batch} {name}: {t * 1e3:.3f} ms/step (median of {args.reps} alternated)", flush=True)
        config = {**base, "batch": batch}
        if clocks.summary():
            config["clocks"] = clocks.summary()
            print(f"SM clock during the timings: {clocks.summary()}", flush=True)
        bf16_rate = batch / seconds["bfloat16"] if "bfloat16" in seconds else None
        for name in sorted(seconds, key=lambda name: name == "bfloat16"):  # the baseline's own row last
            rows.append(record(out, f"int8_decode_batch{batch}", {**config, "weights": name}, "tokens_per_s",
                               batch / seconds[name], "tok/s", *(("bfloat16", bf16_rate) if name != "bfloat16" else ())))
        if {"int8", "int8_megakernel"} <= steps.keys():
            rows.append(megakernel_agrees(out, {**base, "batch": batch}, steps, variants))
        del steps

    print_rows(rows, KEYS)


def megakernel_agrees(out: str, config: dict, steps: dict, variants: dict) -> dict:
    """One more step of the int8 step and of the megakernel's, which have taken the same steps from the same state:
    the megakernel's logits against the served int8 step's (largest error over the largest logit, < 5e-2)."""
    logits = {name: np.asarray(steps[name][0](variants[name], *steps[name][1:])[1], np.float64)
              for name in ("int8", "int8_megakernel")}
    error = float(np.abs(logits["int8_megakernel"] - logits["int8"]).max() / np.abs(logits["int8"]).max())
    agree = bool((logits["int8_megakernel"].argmax(-1) == logits["int8"].argmax(-1)).all())
    print(f"megakernel logits against the int8 step's: largest error {error:.2e} of the largest; greedy tokens "
          f"{'the same' if agree else 'differ'}", flush=True)
    return record(out, "int8_megakernel_logits_error", {**config, "against": "int8", "greedy_agrees": agree,
                                                        "ok": error < 5e-2}, "error_vs_max_logit", error, "1")


if __name__ == "__main__":
    main()
