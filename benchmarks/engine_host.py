"""Host time per engine step: the scheduler, step inputs, commits and streaming, with no device work at all.

The engine plans and dispatches step N+1 before it reads step N, so its host work is hidden only while it
stays below the device's step time: on the H100 the 8B model's 219-row decode step takes 24.75 ms
(results/decode_profile_gpu.jsonl). Here the runner returns at once, so the wall time per step is the host's.
The time is the process's CPU time (one thread: the engine's), which this noisy 2-core VM disturbs less
than wall time. The baseline is the same load through another git revision's engine, alternated with
this tree's in separate processes, 5 times each; the fastest run of each counts (the load is
deterministic; slower runs are the machine's noise).

    .venv/bin/python benchmarks/engine_host.py [--baseline REV] [--rows 1,32,219]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(rows: int, input_len: int, output_len: int) -> dict:
    """Runs in the tree given by --tree: `rows` requests at once on `rows` slots through a null runner."""
    import random

    import numpy as np

    from jaxserve.checkpoint.random_model import preset, synthetic_tokenizer
    from jaxserve.config import EngineConfig, SamplingParams
    from jaxserve.engine.batch import NUM_TOP, StepOutput
    from jaxserve.engine.engine import Engine

    class NullRunner:
        """Samples token 5 with log-probability -1 for every row, at once."""

        def dispatch(self, inp):
            packed = np.zeros((inp.tokens.shape[0], 2 + 2 * NUM_TOP), np.float32)
            packed[:, 0], packed[:, 1] = 5, -1.0
            return lambda: StepOutput.unpack(packed)

    mc = preset("random:llama3-8b")
    pages = -(-(input_len + output_len) // 16)
    cfg = EngineConfig(max_slots=rows, page_size=16, num_pages=rows * pages, max_pages_per_slot=pages,
                       chunk_buckets=(512,), prefill_rows=(1, 2, 4), prefill_tokens=2048)
    engine = Engine(NullRunner(), synthetic_tokenizer(mc.vocab_size), cfg, vocab_size=mc.vocab_size,
                    context_len=mc.max_position_embeddings)
    rng = random.Random(0)
    prompts = [[rng.randrange(mc.vocab_size - 1) for _ in range(input_len)] for _ in range(rows)]
    start, cpu = time.perf_counter(), time.process_time()
    engine.generate(prompts, [SamplingParams(max_tokens=output_len, ignore_eos=True)] * rows)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    import jaxserve

    tree = os.path.dirname(os.path.dirname(os.path.abspath(jaxserve.__file__)))
    return {"engine": tree, "steps": engine.stats.steps, "decode_steps": engine.stats.decode_steps, "wall_s": wall,
            "ms_per_step": cpu / engine.stats.steps * 1e3}


def run_in(tree: str, rows: int, input_len: int, output_len: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(rows), "--tree", tree, "--input-len",
           str(input_len), "--output-len", str(output_len)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the load failed in {tree}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if os.path.commonpath([result["engine"], tree]) != tree:
        raise SystemExit(f"the load meant for {tree} ran the engine at {result['engine']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="c0cb531", help="git revision of the baseline engine (default: before "
                    "session 12's host-path changes)")
    ap.add_argument("--rows", default="1,32,219")
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # the child's source tree
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/engine_host.jsonl"))
    args = ap.parse_args()
    if args.child:  # the tree under test first: ROOT, put first above for this script's own imports, is not it
        sys.path.insert(0, args.tree)
        print(json.dumps(child(args.child, args.input_len, args.output_len)))
        return
    from benchmarks.common import record

    head = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip()
    base = tempfile.mkdtemp(prefix="jaxserve-baseline-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.baseline], check=True,
                   capture_output=True)
    try:
        print(f"host time per engine step: this tree against {args.baseline}, {args.input_len} in / "
              f"{args.output_len} out, rows requests on rows slots; CPU time, fastest of {args.reps}", flush=True)
        for rows in [int(r) for r in args.rows.split(",")]:
            ours, theirs = [], []
            for _ in range(args.reps):  # alternated, so that drifts of the machine fall on both
                theirs.append(run_in(base, rows, args.input_len, args.output_len))
                ours.append(run_in(ROOT, rows, args.input_len, args.output_len))
            mine = min(r["ms_per_step"] for r in ours)
            baseline = min(r["ms_per_step"] for r in theirs)
            record(args.out, "engine_host_ms_per_step", {"rows": rows, "input_len": args.input_len,
                   "output_len": args.output_len, "steps": ours[0]["steps"], "runs_ms": [r["ms_per_step"] for r in ours],
                   "baseline_runs_ms": [r["ms_per_step"] for r in theirs], "tree": head,
                   "timer": f"CPU time, fastest of {args.reps}"}, "ms_per_step", mine, "ms",
                   f"engine at {args.baseline}", baseline, higher_is_better=False)
            print(f"  {rows:4d} rows: {mine:7.3f} ms/step, baseline {baseline:7.3f} ms/step: {baseline / mine:.2f}x",
                  flush=True)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], capture_output=True)


if __name__ == "__main__":
    main()
