"""A batch-1 decode step through the decode megakernel against the served steps, on an 8B-shaped Llama (H100).

Three steps in one process, each from the same token at context 256, dispatched back to back as the engine does:
- bfloat16, jaxserve's served step (`jaxserve.step.step_fn` through `int8_gpu.decode_step`): the baseline;
- int8, the served step (one Pallas kernel a product, XLA between them): today's ratio;
- int8 through the megakernel: `jaxserve.model.transformer.decode_stacked` (embedding, every layer in
  `pallas_kernels.decode_megakernel`'s one kernel, final norm and head) and the greedy token, with the int8 layers
  stacked (`stack_layers`) and the K/V pages stacked across the layers (`stack_pages`), at 16- and 128-position
  pages.
Before timing, the megakernel's logits are checked against the served int8 step's on the served step's own cache
(its pages stacked): the same model, the same K/V.

    PYTHONPATH=. python3 benchmarks/megakernel_step_gpu.py     # writes benchmarks/results/megakernel_step_gpu.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, decode_inputs, decode_step, run_steps  # noqa: E402
from jaxserve.config import QuantConfig  # noqa: E402
from jaxserve.model.quant import quantize_weights  # noqa: E402
from jaxserve.model.sampler import greedy  # noqa: E402  (the served step's greedy token, for the same work after the head)
from jaxserve.model.transformer import decode_stacked  # noqa: E402
from jaxserve.model.weights import random_weights  # noqa: E402
from pallas_kernels.decode_megakernel import stack_layers, stack_pages  # noqa: E402

CONTEXT = 256  # tokens already cached (int8_gpu.py's)
ROW_MAJOR = "row-major"  # not a kernel trial: the megakernel on layers stacked row-major (stack_layers(tiles=False))


THREE_PASS = "three-pass"  # not a kernel trial: the greedy token in jaxserve.step's three passes (XLA:CPU's)


def megakernel_step(cfg, page_size: int, trial: str = ""):
    """jit of (weights, stacked layers, tokens, lengths, table, k, v) -> (token, its log-probability, k, v), the
    pages donated (written in place). `trial`: a kernel trial, or one of this benchmark's: ROW_MAJOR, THREE_PASS,
    "programs=N" (the kernel on N programs instead of one an SM)."""
    options = {"programs": int(trial.split("=")[1])} if trial.startswith("programs=") else {"trial": trial}
    if trial in (ROW_MAJOR, THREE_PASS):
        options = {}

    def step(weights, layers, tokens, lengths, table, k_pages, v_pages):
        logits, k_pages, v_pages = decode_stacked(weights, layers, cfg, tokens, lengths, table, k_pages, v_pages,
                                                  page_size, backend="mosaic_gpu", **options)
        token, chosen = greedy(logits, one_pass=None if trial != THREE_PASS else False)
        return token, chosen, logits, k_pages, v_pages

    return jax.jit(step, donate_argnums=(5, 6))


def relative_error(got, want) -> float:
    """The largest difference of two logit rows, relative to `want`'s largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def time_megakernel(fn, args, pages, steps: int) -> tuple[float, tuple]:
    """(seconds a step over `steps` steps dispatched back to back, the pages fed from one step to the next; the
    pages)."""
    k_pages, v_pages = pages
    t0 = time.perf_counter()
    for _ in range(steps):
        token, _, _, k_pages, v_pages = fn(*args, k_pages, v_pages)
    jax.block_until_ready(token)
    return (time.perf_counter() - t0) / steps, (k_pages, v_pages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="50,200",
                    help="steps a timing, comma-joined: each count timed for every step (fill and drain of the "
                         "dispatch included, so short timings weigh them more)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (a quick check)")
    ap.add_argument("--trial", action="append", default=[],
                    help="also check and time the megakernel with this trial (e.g. auto-barriers; or row-major: "
                         "the layers stacked row-major, not as tiles; three-pass: the greedy token in three passes; "
                         "programs=N: the kernel on N programs); repeatable")
    ap.add_argument("--trial-pages", default="16,128",
                    help="page sizes the trials run at (at 16 a trial is checked against the served int8 step, at "
                         "128 against the kernel without it, on the same random pages)")
    ap.add_argument("--hlo", action="store_true", help="print the megakernel step's compiled operations")
    ap.add_argument("--profile", action="store_true",
                    help="after the timings, where 20 megakernel steps (128-position pages) spend the device's time")
    ap.add_argument("--out", default="benchmarks/results/megakernel_step_gpu.jsonl")
    args = ap.parse_args()
    cfg = dataclasses.replace(LLAMA_8B, num_layers=args.layers or LLAMA_8B.num_layers)
    print(f"{jax.devices()[0]} jax {jax.__version__}, {cfg.num_layers} layers", flush=True)

    bf16_weights = random_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    int8_weights = quantize_weights(bf16_weights, QuantConfig(mode="int8"), jnp.bfloat16)
    bf16 = decode_step(cfg, bf16_weights, 1, CONTEXT)  # (step, state, inp), run once
    int8 = decode_step(cfg, int8_weights, 1, CONTEXT)
    layers = stack_layers(cfg, int8_weights.layers)
    row_major = stack_layers(cfg, int8_weights.layers, tiles=False) if ROW_MAJOR in args.trial else None

    def layers_of(trial):
        return row_major if trial == ROW_MAJOR else layers
    page_size = int8[1].cache.page_size
    inp = decode_inputs(1, CONTEXT, -(-(CONTEXT + 1) // page_size), cfg.vocab_size)  # what decode_step packed
    tokens, lengths = jnp.asarray(inp["tokens"]), jnp.asarray(inp["positions"][:, 0])
    table = jnp.asarray(inp["page_table"])

    # the check: the served int8 step again on its cache, against the megakernel on that cache stacked
    state = int8[1]
    pages = (stack_pages(state.cache.k), stack_pages(state.cache.v))  # (copies: the served step donates its state)
    _, served_logits, state = int8[0](int8_weights, state, int8[2])
    int8 = (int8[0], state, int8[2])
    fns = {page_size: megakernel_step(cfg, page_size)}

    def check(fn, pages, name, trial=""):  # the megakernel's logits on the served step's cache against the served
        # step's
        t0 = time.perf_counter()
        token, _, logits, *pages = fn(int8_weights, layers_of(trial), tokens, lengths, table, *pages)
        print(f"{name} compiled and run in {time.perf_counter() - t0:.0f} s", flush=True)
        error = relative_error(logits[0], served_logits[0])
        agree = int(token[0]) == int(np.argmax(np.asarray(served_logits[0])))
        print(f"{name}: logits against the served int8 step's: largest error {error:.2e} of the largest; greedy "
              f"token {'the same' if agree else 'differs'}", flush=True)
        if not error < 5e-2:
            raise SystemExit(f"{name}: the megakernel's logits are not the served step's")
        return error, agree, pages

    error, agree, pages = check(fns[page_size], pages, "megakernel step")

    # 128-position pages: a fresh stacked pool of the same context
    big = 128
    pool = -(-(CONTEXT + 1) // big)
    rows = cfg.num_layers * cfg.num_kv_heads * pool * big
    big_table = jnp.arange(pool, dtype=jnp.int32)[None]
    trials = ["", *args.trial]
    mk = {(page_size, ""): (table, tuple(pages))}  # (page size, trial) -> (table, pages)
    trial_sizes = [int(n) for n in args.trial_pages.split(",")]

    def big_pages():  # the same random K and V every time (K at an eighth, so a key more or less shows)
        keys = jax.random.split(jax.random.PRNGKey(7))
        return tuple((jax.random.normal(key, (rows, cfg.head_dim)) * scale).astype(jnp.bfloat16)
                     for key, scale in zip(keys, (0.125, 1.0)))
    for trial in trials:
        for size in (page_size, big) if not trial else [n for n in (page_size, big) if n in trial_sizes]:
            if (size, trial) not in mk:
                fns[size, trial] = megakernel_step(cfg, size, trial)
                if size == page_size:  # a trial's outputs checked as the kernel's were
                    served_pages = [stack_pages(c) for c in (state.cache.k, state.cache.v)]
                    try:
                        mk[size, trial] = (table, tuple(check(fns[size, trial], served_pages, f"trial {trial}",
                                                              trial)[2]))
                    except (Exception, SystemExit) as e:  # (a trial that fails to build or check is left out)
                        print(f"trial {trial} left out: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        break
                else:
                    mk[size, trial] = (big_table, big_pages())
            if args.hlo and size == big:
                fn = fns.get((size, trial), fns.get(size))
                print_ops(fn.lower(int8_weights, layers_of(trial), tokens, lengths, *mk[size, trial][0:1],
                                   *mk[size, trial][1]))
    fns[page_size, ""] = fns.pop(page_size)
    first_logits = {}
    for key in mk:  # once each, compiled
        table_, pages_ = mk[key]
        _, _, first_logits[key], k_pages, v_pages = fns[key](int8_weights, layers_of(key[1]), tokens, lengths, table_,
                                                             *pages_)
        mk[key] = (table_, (k_pages, v_pages))
    for key in mk:  # a trial at 128-position pages against the kernel without it, both on the same random pages
        if key[0] == big and key[1]:
            trial_error = relative_error(first_logits[key][0], first_logits[big, ""][0])
            print(f"trial {key[1]} at {big}-position pages: logits against the kernel's without it: largest error "
                  f"{trial_error:.2e} of the largest", flush=True)
            if not trial_error < 1e-2:
                raise SystemExit(f"trial {key[1]}: its logits are not the kernel's")

    states = {"bfloat16": bf16[1], "int8": int8[1]}
    weights = {"bfloat16": bf16_weights, "int8": int8_weights}
    steps_of = {"bfloat16": bf16, "int8": int8}
    labels = {"bfloat16": "bfloat16, served", "int8": "int8, served",
              **{key: f"int8, megakernel, {key[0]}-position pages{f', trial {key[1]}' if key[1] else ''}"
                 for key in mk}}
    for steps in (int(n) for n in args.steps.split(",")):
        times: dict = {key: [] for key in labels}
        for _ in range(args.reps):  # alternated
            for name in ("bfloat16", "int8"):
                t, states[name] = run_steps(steps_of[name][0], weights[name], states[name], steps_of[name][2], steps)
                times[name].append(t)
            for key in mk:
                t, new_pages = time_megakernel(fns[key], (int8_weights, layers_of(key[1]), tokens, lengths,
                                                          mk[key][0]), mk[key][1], steps)
                mk[key] = (mk[key][0], new_pages)
                times[key].append(t)
        med = {k: float(np.median(v)) for k, v in times.items()}
        base = med["bfloat16"]
        print(f"\n{f'step (batch 1, context 256), {steps} steps a timing':<56}{'ms':>8}{'tokens/s':>10}"
              f"{'vs bfloat16':>13}")
        for key, label in labels.items():
            print(f"{label:<56}{med[key] * 1e3:>8.3f}{1 / med[key]:>10.1f}{base / med[key]:>12.3f}x")
            config = {"model": "8B-shaped Llama, random weights", "layers": cfg.num_layers, "context": CONTEXT,
                      "batch": 1, "steps": steps, "reps": args.reps, "step": label,
                      "logits_error_vs_served_int8": error, "greedy_agrees": agree}
            if key != "bfloat16":
                record(args.out, "megakernel_decode_step", config, "tokens_per_s", 1 / med[key], "tokens/s",
                       "bfloat16 served step, batch 1 (same process)", 1 / base)
    if args.profile:
        print_profile(fns[big, ""], (int8_weights, layers, tokens, lengths, mk[big, ""][0]), mk[big, ""][1])


def print_profile(fn, args, pages, steps: int = 20) -> None:
    """Each kernel's device time a step over `steps` megakernel steps, and the idle time between kernels."""
    from benchmarks.decode_profile_gpu import busy_ns, device_profile, gaps_ns

    intervals, time_by, count_by = device_profile(lambda: time_megakernel(fn, args, pages, steps))
    busy, span = busy_ns(intervals)
    large, count, small = gaps_ns(intervals)
    print(f"\nprofile of {steps} megakernel steps (128-position pages): busy {busy / steps / 1e3:.1f} us a step, span "
          f"{span / steps / 1e3:.1f}, gaps under 10 us {small / steps / 1e3:.1f}, longer {large / steps / 1e3:.1f} "
          f"({count})", flush=True)
    for name, t in time_by.most_common(16):
        print(f"    {t / steps / 1e3:9.1f} us  x{count_by[name] / steps:.0f}  {name}", flush=True)


def print_ops(lowered) -> None:
    """The compiled step's top-level operations (what runs around the kernel), by kind, with their shapes."""
    text = lowered.compile().as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    skip = ("parameter(", "get-tuple-element(", "tuple(", "bitcast(", "constant(")
    ops = [line.strip() for line in entry.split("\n")[1:] if not any(k in line for k in skip)]
    print(f"the megakernel step, compiled: {len(ops)} operations besides parameters and tuples", flush=True)
    for op in ops:
        print("   ", op[:200], flush=True)

if __name__ == "__main__":
    main()
