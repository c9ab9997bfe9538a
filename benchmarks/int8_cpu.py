"""CPU figures of int8 weights on the embedded SmolLM2, each against float32 measured in the same run.

1. Perplexity over a held-out public-domain text (benchmarks/data), sliding windows of 1024 tokens
   with stride 512: int8 (per output channel, head included) against float32.
2. Linear-layer bytes of the int8 model against the same layers in bfloat16.
3. Greedy generations through the engine: the share of tokens equal to float32's, position by
   position (free-running: after a first difference the texts part ways), and the teacher-forced
   share: int8's top token on float32's own greedy text, at each generated position.

    PYTHONPATH=. .venv/bin/python benchmarks/int8_cpu.py [--context 1024] [--stride 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_rows, record  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "heldout_public_domain.txt")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first", "The theory of relativity states that"]


def teacher_forced_agreement(model, prompt: list[int], reference_out: list[int]) -> float:
    """The share of positions where `model`'s top token, given the reference's own text so far, is the reference's."""
    import numpy as np

    from tests.helpers import logits_of

    logits = logits_of(model, prompt + reference_out)
    picks = np.argmax(logits[len(prompt) - 1: len(prompt) + len(reference_out) - 1], axis=-1)
    return float(np.mean(picks == np.asarray(reference_out)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", default="benchmarks/results/int8_cpu.jsonl")
    ap.add_argument("--skip-perplexity", action="store_true")
    args = ap.parse_args()

    from jaxserve.checkpoint import embedded_model_path, load_model
    from jaxserve.config import QuantConfig, SamplingParams, engine_config_for
    from jaxserve.model.quant import linear_bytes
    from jaxserve.perplexity import perplexity
    from jaxserve.runner import build_engine

    path = embedded_model_path()
    qcfg = QuantConfig(mode="int8")
    models = {"float32": load_model(path, dtype="float32"), "int8": load_model(path, dtype="float32", quantize=qcfg)}
    with open(TEXT, encoding="utf-8") as f:
        ids = models["float32"].tokenizer.encode(f.read())
    base = {"model": "SmolLM2-135M-Instruct Q4_1->f32", "quantization": "int8 per output channel, head included"}
    rows = []

    ppl = {}
    for name, model in models.items() if not args.skip_perplexity else ():
        start = time.perf_counter()
        ppl[name] = perplexity(model, ids, context=args.context, stride=args.stride, attention="reference")
        print(f"{name}: {ppl[name]} in {time.perf_counter() - start:.0f} s", flush=True)
    if ppl:
        cfg = {**base, "text": os.path.relpath(TEXT), "tokens": ppl["int8"]["tokens"], "context": ppl["int8"]["context"],
               "stride": ppl["int8"]["stride"]}
        rows.append(record(args.out, "int8_perplexity", cfg, "perplexity", ppl["int8"]["perplexity"], "ppl",
                           "float32", ppl["float32"]["perplexity"], higher_is_better=False))

    bf16_bytes = linear_bytes(models["float32"].weights) // 2  # the same elements at 2 bytes
    rows.append(record(args.out, "int8_linear_bytes", base, "linear_layer_bytes", linear_bytes(models["int8"].weights),
                       "bytes", "bfloat16", bf16_bytes, higher_is_better=False))

    tok = models["float32"].tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = {}
    for name, model in models.items():
        engine = build_engine(model, engine_config_for([len(p) for p in prompts], args.new))
        params = [SamplingParams(max_tokens=args.new, ignore_eos=True)] * len(prompts)
        outs[name] = [r.output_ids for r in engine.generate(prompts, params)]
    equal = sum(a == b for fa, qa in zip(outs["float32"], outs["int8"]) for a, b in zip(fa, qa))
    total = sum(len(fa) for fa in outs["float32"])
    prefix = [next((i for i, (a, b) in enumerate(zip(fa, qa)) if a != b), len(fa))
              for fa, qa in zip(outs["float32"], outs["int8"])]
    cfg = {**base, "prompts": len(prompts), "new_tokens": args.new, "common_prefix_tokens": prefix}
    rows.append(record(args.out, "int8_greedy_agreement", cfg, "equal_token_share", equal / total, "fraction"))
    forced = [teacher_forced_agreement(models["int8"], p, o) for p, o in zip(prompts, outs["float32"])]
    cfg = {**base, "prompts": len(prompts), "new_tokens": args.new, "per_prompt": forced}
    rows.append(record(args.out, "int8_greedy_agreement", cfg, "teacher_forced_equal_share", sum(forced) / len(forced),
                       "fraction"))

    print_rows(rows)


if __name__ == "__main__":
    main()
