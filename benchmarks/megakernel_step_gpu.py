"""The decode megakernel's step against the served int8 step, its baseline (Hopper GPU).

Both are the engine's own compiled decode steps, batch 1, context 256, on an 8B-shaped Llama with random int8
weights and the same page size: `jaxserve.step.step_fn` (a kernel a product) and `stacked_step_fn`
(EngineConfig.decode_megakernel: every layer in one kernel, pallas_kernels/decode_megakernel, the layers and pages
stacked). The megakernel step's logits are checked against the int8 step's on the same cache, then both are timed,
alternated, steps dispatched back to back as the engine does; the megakernel's tokens/s is recorded against the int8
step's.

    PYTHONPATH=. python3 benchmarks/megakernel_step_gpu.py     # writes benchmarks/results/megakernel_step_gpu.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, decode_step, run_steps  # noqa: E402
from jaxserve.config import QuantConfig  # noqa: E402
from jaxserve.model.quant import quantize_weights  # noqa: E402
from jaxserve.model.weights import random_weights  # noqa: E402
from pallas_kernels.decode_megakernel import stack_layers  # noqa: E402

CONTEXT = 256  # tokens already cached (int8_gpu.py's)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="50,200",
                    help="steps a timing, comma-joined: each count timed for both steps (fill and drain of the "
                         "dispatch included, so short timings weigh them more)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (a quick check)")
    ap.add_argument("--page-size", type=int, default=128, help="positions a KV page (configs/serve-int8-latency's)")
    ap.add_argument("--out", default="benchmarks/results/megakernel_step_gpu.jsonl")
    args = ap.parse_args()
    cfg = dataclasses.replace(LLAMA_8B, num_layers=args.layers or LLAMA_8B.num_layers)
    print(f"{jax.devices()[0]} jax {jax.__version__}, {cfg.num_layers} layers, {args.page_size}-position pages",
          flush=True)

    weights = quantize_weights(random_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16), QuantConfig(mode="int8"),
                               jnp.bfloat16)
    params = {"int8": weights, "megakernel": (weights, stack_layers(cfg, weights.layers))}
    # (decode_step compiles each step and runs it once)
    steps = {name: decode_step(cfg, p, 1, CONTEXT, page_size=args.page_size) for name, p in params.items()}
    states, logits = {}, {}
    for name, (step, state, inp) in steps.items():
        out = step(params[name], state, inp)
        logits[name], states[name] = np.asarray(out[1][0], np.float64), out[-1]
    error = float(np.abs(logits["megakernel"] - logits["int8"]).max() / np.abs(logits["int8"]).max())
    agree = bool(np.argmax(logits["megakernel"]) == np.argmax(logits["int8"]))
    print(f"megakernel logits against the int8 step's: largest error {error:.2e} of the largest; greedy token "
          f"{'the same' if agree else 'differs'}", flush=True)
    if not error < 5e-2:
        raise SystemExit("the megakernel step's logits are not the int8 step's")

    for count in (int(n) for n in args.steps.split(",")):
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.reps):  # alternated
            for name, (step, _, inp) in steps.items():
                t, states[name] = run_steps(step, params[name], states[name], inp, count)
                times[name].append(t)
        med = {name: float(np.median(t)) for name, t in times.items()}
        print(f"\n{f'step (batch 1, context {CONTEXT}), {count} steps a timing':<48}{'ms':>8}{'tokens/s':>10}"
              f"{'vs int8':>9}")
        for name, t in med.items():
            print(f"{name:<48}{t * 1e3:>8.3f}{1 / t:>10.1f}{med['int8'] / t:>8.3f}x")
        config = {"model": "8B-shaped Llama, random weights", "layers": cfg.num_layers, "context": CONTEXT,
                  "page_size": args.page_size, "batch": 1, "steps": count, "reps": args.reps,
                  "logits_error_vs_served_int8": error, "greedy_agrees": agree}
        record(args.out, "megakernel_decode_step", config, "tokens_per_s", 1 / med["megakernel"], "tokens/s",
               "int8 served step, batch 1 (same process)", 1 / med["int8"])


if __name__ == "__main__":
    main()
