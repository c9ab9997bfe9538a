"""CPU time to first token and decode speed of the embedded SmolLM2, against transformers.

Both run float32 on the same cores in one process, greedy, the same prompt and lengths:
    .venv/bin/python benchmarks/cpu_smollm.py [--prompt-len 128] [--new 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu_smollm.jsonl")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.checkpoint import embedded_model_path, load_model
    from jaxserve.config import SamplingParams
    from jaxserve.generate import Generator

    path = embedded_model_path()
    model = load_model(path, dtype="float32")
    text = "The history of the city begins with a small settlement on the river. " * 40
    prompt = model.tokenizer.encode(text)[: args.prompt_len]
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    gen = Generator(model)
    gen.generate([prompt], [params])  # compile
    ttft, tps = [], []
    for _ in range(args.repeats):
        gen.generate([prompt], [params])
        assert gen.last_stats is not None
        ttft.append(gen.last_stats.prefill_s)
        tps.append(gen.last_stats.decode_tokens_per_s)

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
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

    cfg = {"model": "SmolLM2-135M-Instruct Q4_1->f32", "prompt_len": len(prompt), "new_tokens": args.new,
           "batch": 1, "cpu_threads": os.cpu_count()}
    rows = [
        record(args.out, "cpu_smollm", cfg, "ttft_s", statistics.median(ttft), "s", "transformers",
               statistics.median(hf_ttft), higher_is_better=False),
        record(args.out, "cpu_smollm", cfg, "decode_tokens_per_s", statistics.median(tps), "tok/s", "transformers",
               statistics.median(hf_tps)),
    ]
    print(f"{'metric':<22}{'jaxserve':>12}{'transformers':>14}{'ratio':>8}")
    for r in rows:
        print(f"{r['metric']:<22}{r['value']:>12.3f}{r['baseline_value']:>14.3f}{r['ratio']:>8.2f}")


if __name__ == "__main__":
    main()
