"""Host time to dispatch one decode step of the engine (StepRunner.dispatch), against the device's time for it.

The engine hides its host work behind the step in flight only while that work stays below the step's device
time. On the H100 the 8B model's 256-row float8 decode step takes ~22 ms on the device, and the offline load
(serving_gpu.py) spent 11-18 ms of host time per step in `dispatch` alone. This times, for the 8B shape cut to
--layers layers (dispatch cost grows with the kernels a step launches, so per layer is what counts):
  build     StepInput.build for 256 decode rows (numpy only)
  numpy     runner.dispatch on numpy inputs, copied to the device on every call (what the engine does)
  device    the same call on inputs already on the device, the same arrays every time
and the device time per step (steps back to back, waited on at the end). Each XLA flag variant runs in its own
process (XLA reads its flags once).

    PYTHONPATH=. python3 benchmarks/dispatch_gpu.py --layers 8 --variants default,no-command-buffer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = {  # name: XLA_FLAGS added
    "default": "",
    "no-command-buffer": "--xla_gpu_enable_command_buffer=",
}


def child(layers: int, rows: int, context: int, kv_dtype: str, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import dispatched_back_to_back
    from jaxserve.checkpoint import LoadedModel
    from jaxserve.checkpoint.random_model import preset, synthetic_tokenizer
    from jaxserve.config import EngineConfig, SamplingParams
    from jaxserve.engine.batch import StepInput
    from jaxserve.engine.request import Request
    from jaxserve.engine.scheduler import Chunk
    from jaxserve.model.weights import random_weights
    from jaxserve.step import StepRunner, pack_step_input

    mc = dataclasses.replace(preset("random:llama3-8b"), num_layers=layers)
    model = LoadedModel(mc, random_weights(mc, jax.random.key(0), jnp.bfloat16), synthetic_tokenizer(mc.vocab_size),
                        "random:llama3-8b")
    pages = -(-(context + 1) // 16)
    cfg = EngineConfig(max_slots=rows, page_size=16, num_pages=rows * pages + 1, max_pages_per_slot=pages,
                       chunk_buckets=(16,), decode_page_buckets=(pages,), decode_row_buckets=(rows,),
                       kv_cache_dtype=kv_dtype)
    start = time.perf_counter()
    runner = StepRunner(model, cfg)
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    chunks = []
    for slot in range(rows):  # decode rows at `context` tokens, each on random pages of the pool (rows may share)
        r = Request(str(slot), [int(t) for t in rng.integers(0, mc.vocab_size - 1, context)],
                    SamplingParams(max_tokens=8, ignore_eos=True), slot, slot=slot,
                    pages=[int(p) for p in rng.permutation(rows * pages)[:pages] + 1], num_computed=context - 1)
        chunks.append(Chunk(r, context - 1, 1, True))

    def timed(fn, n):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    build_s = timed(lambda: StepInput.build(chunks, 1, pages, rows), steps)
    inp = StepInput.build(chunks, 1, pages, rows)
    compiled = runner._compiled[inp.shape]
    numpy_s, device_s = dispatched_back_to_back(runner, inp, steps)  # waited on once: the device's time a step
    on_device = jax.device_put(pack_step_input(inp))
    jax.block_until_ready(on_device)
    outs = []

    def call():
        packed, _, runner.state = compiled(runner.weights, runner.state, on_device)
        outs.append(packed)

    call()
    jax.block_until_ready(outs.pop())
    t = time.perf_counter()
    for _ in range(steps):
        call()
    device_args_s = (time.perf_counter() - t) / steps
    jax.block_until_ready(outs)
    return {"layers": layers, "rows": rows, "context": context, "kv_dtype": kv_dtype, "compile_s": compile_s,
            "build_ms": build_s * 1e3, "dispatch_numpy_ms": numpy_s * 1e3, "dispatch_device_args_ms": device_args_s * 1e3,
            "device_step_ms": device_s * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--kv-dtype", default="float8_e4m3fn")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/dispatch_gpu.jsonl"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.layers, args.rows, args.context, args.kv_dtype, args.steps)))
        return
    from benchmarks.common import record

    rows = {}
    for name in args.variants.split(","):
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip()}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--layers", str(args.layers), "--rows",
               str(args.rows), "--context", str(args.context), "--kv-dtype", args.kv_dtype, "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        r = rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:18s} {args.layers} layers: build {r['build_ms']:.2f} ms, dispatch numpy {r['dispatch_numpy_ms']:.2f} "
              f"ms, device args {r['dispatch_device_args_ms']:.2f} ms, device step {r['device_step_ms']:.2f} ms "
              f"(compile {r['compile_s']:.0f} s)", flush=True)
        base = rows.get("default")
        record(args.out, "decode_dispatch_host_ms", {**r, "variant": name, "xla_flags": VARIANTS[name]},
               "dispatch_numpy_ms", r["dispatch_numpy_ms"], "ms", "default" if base else None,
               base["dispatch_numpy_ms"] if base else None, higher_is_better=False)


if __name__ == "__main__":
    main()
