"""CPU figures of the embedded SmolLM2 (float32), each against a baseline measured in the same run.

1. Batch-1 time to first token and decode tokens/s through the engine, against transformers'
   `generate` on the same GGUF, prompt and lengths (greedy).
2. Engine throughput with 32 concurrent requests against 1 request, same lengths.

    .venv/bin/python benchmarks/cpu_smollm.py [--prompt-len 128] [--new 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_rows, record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/cpu_smollm.jsonl")
    ap.add_argument("--only", choices=("single", "batching"), default=None, help="run one of the two parts")
    ap.add_argument("--shapes", default=None, help="input/output lengths of part 2, e.g. 32/128,128/64")
    args = ap.parse_args()

    from jaxserve.bench import bench_config, run_bench
    from jaxserve.checkpoint import embedded_model_path, load_model

    path = embedded_model_path()
    model = load_model(path, dtype="float32")
    rows = []

    # 1. batch 1 against transformers
    if args.only != "batching":
        rows += single_vs_transformers(args, model, path)

    # 2. continuous batching: N concurrent requests against 1, a decode-heavy and a prefill-heavy shape.
    # The two runs alternate `repeats` times and the medians are compared, so drift in the machine's
    # load hits both sides alike.
    shapes = [tuple(map(int, s.split("/"))) for s in args.shapes.split(",")] if args.shapes else \
        [(32, 128), (args.prompt_len, args.new)]
    for input_len, output_len in shapes if args.only != "single" else ():
        ones, manys = [], []
        for _ in range(args.repeats):
            ones.append(run_bench(model, 1, input_len, output_len, bench_config(1, input_len, output_len)))
            manys.append(run_bench(model, args.concurrent, input_len, output_len,
                                   bench_config(args.concurrent, input_len, output_len)))
        one_tps = statistics.median(r["output_tokens_per_s"] for r in ones)
        many_tps = statistics.median(r["output_tokens_per_s"] for r in manys)
        many = manys[[r["output_tokens_per_s"] for r in manys].index(many_tps)] if args.repeats % 2 else manys[0]
        cfg = {"model": "SmolLM2-135M-Instruct Q4_1->f32", "input_len": input_len, "output_len": output_len,
               "requests": args.concurrent, "cpu_threads": os.cpu_count(), "repeats": args.repeats,
               "ttft_p50_s": many["ttft_p50_s"], "itl_p50_s": many["itl_p50_s"],
               "runs_tokens_per_s": {"1": [r["output_tokens_per_s"] for r in ones],
                                     str(args.concurrent): [r["output_tokens_per_s"] for r in manys]}}
        rows.append(record(args.out, f"cpu_engine_batching_{input_len}in_{output_len}out", cfg, "output_tokens_per_s",
                           many_tps, "tok/s", "1 request", one_tps))

    print_rows(rows)


def single_vs_transformers(args, model, path: str) -> list[dict]:
    """Batch-1 time to first token and decode tokens/s: the engine against transformers' generate."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.bench import run_bench

    rows: list[dict] = []
    single = [run_bench(model, 1, args.prompt_len, args.new, seed=i) for i in range(args.repeats)]
    ttft = statistics.median(r["ttft_p50_s"] for r in single)
    tps = statistics.median(1.0 / r["itl_p50_s"] for r in single)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    hf_ttft, hf_tps = [], []
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, do_sample=False)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            total = time.perf_counter() - t0
            hf_ttft.append(first)
            hf_tps.append((args.new - 1) / max(total - first, 1e-9))
    cfg = {"model": "SmolLM2-135M-Instruct Q4_1->f32", "prompt_len": args.prompt_len, "new_tokens": args.new,
           "batch": 1, "cpu_threads": os.cpu_count()}
    rows.append(record(args.out, "cpu_smollm", cfg, "ttft_s", ttft, "s", "transformers generate",
                       statistics.median(hf_ttft), higher_is_better=False))
    rows.append(record(args.out, "cpu_smollm", cfg, "decode_tokens_per_s", tps, "tok/s", "transformers generate",
                       statistics.median(hf_tps)))
    return rows


if __name__ == "__main__":
    main()
