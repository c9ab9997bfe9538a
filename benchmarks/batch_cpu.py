"""Offline throughput of a batch job against `jaxserve bench`, same model, lengths and engine (CPU).

Both sides run N requests of `--input-len` random prompt tokens and exactly `--output-len` output
tokens (ignore_eos) through an engine of the same EngineConfig (`jaxserve.bench.bench_config`):

- baseline, `jaxserve bench`: `run_bench`, every request submitted at once to `Engine.generate`;
- `jaxserve batch`: the same prompts as an OpenAI batch JSONL file (token-id prompts), run by
  `BatchJob` exactly as the command runs it: streamed input, at most `max_in_flight` requests in
  the engine, results appended and fsynced, progress bar, records built per request.

Each side builds its own engine (so no prefix cache is shared) and warms it with one short request;
throughput counts output tokens from the first submit to the last result, without loading or
compiling. The two sides alternate `--repeats` times and the medians are compared.

    PYTHONPATH=. python3 benchmarks/batch_cpu.py [--requests 64 --input-len 128 --output-len 64] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import record  # noqa: E402


def batch_run(model, prompts: list[list[int]], output_len: int, cfg, workdir: str, run: int) -> dict:
    """Runs the prompts as a batch job on a fresh engine; returns its summary."""
    from jaxserve.config import BatchConfig, SamplingParams
    from jaxserve.jobs.runner import BatchJob
    from jaxserve.runner import build_engine

    src = os.path.join(workdir, f"in-{run}.jsonl")
    with open(src, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": p, "max_tokens": output_len, "ignore_eos": True}}) + "\n")
    job_cfg = BatchConfig(input=src, output=os.path.join(workdir, f"out-{run}.jsonl"), engine=cfg,
                          sampling=SamplingParams(max_tokens=output_len))
    engine = build_engine(model, cfg)
    engine.generate(prompts[:1], [SamplingParams(max_tokens=2, ignore_eos=True)])  # first-run effects, as run_bench
    with BatchJob(job_cfg, shard_index=0) as job:
        summary = job.run(engine, "SmolLM2-135M-Instruct")
    assert summary.completed == len(prompts) and summary.output_tokens == len(prompts) * output_len, summary
    return summary.to_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check that the script runs")
    ap.add_argument("--out", default="benchmarks/results/batch_cpu.jsonl")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.input_len, args.output_len, args.max_slots = 4, 16, 4, 2
        args.out = os.path.join(tempfile.mkdtemp(), "batch_cpu.jsonl")

    import dataclasses

    from jaxserve.bench import bench_config, run_bench
    from jaxserve.checkpoint import load_model

    model = load_model(None, dtype="float32")
    workdir = tempfile.mkdtemp(prefix="batch_cpu-")
    # One compilation for both sides: the second engine loads every bucket from this cache.
    cfg = dataclasses.replace(bench_config(args.requests, args.input_len, args.output_len, max_slots=args.max_slots),
                              compilation_cache_dir=os.path.join(workdir, "xla"))
    rng = random.Random(0)  # the prompts run_bench(seed=0) makes
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(args.input_len)] for _ in range(args.requests)]
    benches, batches = [], []
    for run in range(args.repeats):
        benches.append(run_bench(model, args.requests, args.input_len, args.output_len, cfg))
        batches.append(batch_run(model, prompts, args.output_len, cfg, workdir, run))
    bench_tps = statistics.median(r["output_tokens_per_s"] for r in benches)
    batch_tps = statistics.median(r["output_tokens_per_s"] for r in batches)
    config = {"model": "SmolLM2-135M-Instruct Q4_1->f32", "requests": args.requests, "input_len": args.input_len,
              "output_len": args.output_len, "max_slots": cfg.max_slots, "max_in_flight": 4 * cfg.max_slots,
              "cpu_threads": os.cpu_count(), "repeats": args.repeats,
              "runs_tokens_per_s": {"batch": [r["output_tokens_per_s"] for r in batches],
                                    "bench": [r["output_tokens_per_s"] for r in benches]},
              "batch_wall_s": [r["wall_s"] for r in batches], "bench_wall_s": [r["wall_s"] for r in benches]}
    row = record(args.out, "batch_cpu", config, "output_tokens_per_s", batch_tps, "tok/s",
                 "jaxserve bench (Engine.generate, same lengths and engine)", bench_tps)
    print(f"output tok/s: jaxserve batch {batch_tps:.2f}, jaxserve bench {bench_tps:.2f}, ratio {row['ratio']:.3f} "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
