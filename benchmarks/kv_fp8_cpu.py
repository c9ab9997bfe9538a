"""What float8_e4m3fn K/V pages cost the embedded SmolLM2 in quality, against float32 pages in the same run (CPU).

1. Perplexity over the held-out public-domain text (benchmarks/data), sliding windows of 1024 tokens with stride
   512, the window's K/V read back from pages of each dtype.
2. Greedy generations through the engine: the share of positions equal to float32's (free-running: after a first
   difference the texts part ways) and each prompt's common prefix.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_fp8_cpu.py [--context 1024] [--stride 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import record  # noqa: E402
from benchmarks.int8_cpu import PROMPTS, TEXT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", default="benchmarks/results/kv_fp8_cpu.jsonl")
    args = ap.parse_args()

    from jaxserve.checkpoint import embedded_model_path, load_model
    from jaxserve.config import SamplingParams, engine_config_for
    from jaxserve.perplexity import perplexity
    from jaxserve.runner import build_engine

    model = load_model(embedded_model_path(), dtype="float32")
    with open(TEXT, encoding="utf-8") as f:
        ids = model.tokenizer.encode(f.read())
    ppl = {d: perplexity(model, ids, context=args.context, stride=args.stride, attention="reference",
                         kv_cache_dtype=d)["perplexity"] for d in ("auto", "float8_e4m3fn")}
    config = dict(model="SmolLM2-135M-Instruct", activations="float32", context=args.context, stride=args.stride,
                  tokens=len(ids) - 1)
    record(args.out, "kv_fp8_perplexity", config, "perplexity", ppl["float8_e4m3fn"], "ppl", "float32 K/V pages",
           ppl["auto"], higher_is_better=False)
    print(f"perplexity: float32 pages {ppl['auto']:.4f}, float8_e4m3fn pages {ppl['float8_e4m3fn']:.4f} "
          f"({ppl['float8_e4m3fn'] / ppl['auto'] - 1:+.2%})")

    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    outs = {}
    for d in ("auto", "float8_e4m3fn"):
        cfg = engine_config_for([len(p) for p in prompts], args.new, attention="reference")
        engine = build_engine(model, dataclasses.replace(cfg, kv_cache_dtype=d))
        params = [SamplingParams(max_tokens=args.new, ignore_eos=True)] * len(prompts)
        outs[d] = [r.output_ids for r in engine.generate(prompts, params)]
    pairs = list(zip(outs["auto"], outs["float8_e4m3fn"]))
    equal = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(len(a) for a, _ in pairs)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    record(args.out, "kv_fp8_greedy_agreement", dict(config, prompts=len(prompts), new_tokens=args.new,
                                                     common_prefix=prefix), "equal_share", equal, "share")
    print(f"greedy: {equal:.1%} of positions equal to float32's; common prefix per prompt {prefix}")


if __name__ == "__main__":
    main()
