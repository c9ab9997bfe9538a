"""Speculative decoding on a CPU: the embedded model at batch 1 over input-grounded prompts
(data/grounded_prompts.jsonl: repeat, edit or quote a passage the prompt holds), n-gram prompt lookup against no
speculation, both through the engine (Engine.generate, one request at a time) in the same run, alternating.
Reports the acceptance rate, output tokens per step of a speculating request, and the end-to-end speedup.

    .venv/bin/python benchmarks/speculative_cpu.py [--tokens 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4, help="speculative tokens a step")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/speculative_cpu.jsonl")
    args = ap.parse_args()

    from jaxserve.checkpoint import embedded_model_path, load_model
    from jaxserve.config import EngineConfig, SamplingParams, SpeculativeConfig
    from jaxserve.runner import build_engine

    model = load_model(embedded_model_path(), dtype="float32")
    with open(os.path.join(os.path.dirname(__file__), "data", "grounded_prompts.jsonl")) as f:
        prompts = [model.tokenizer.encode_chat([{"role": "user", "content": json.loads(line)["prompt"]}]) for line in f]
    cfg = EngineConfig(max_slots=1, page_size=16, num_pages=64, max_pages_per_slot=16, chunk_buckets=(64, 256))
    spec = SpeculativeConfig(method="ngram", num_tokens=args.tokens)
    engines = {"plain": build_engine(model, cfg), "ngram": build_engine(model, dataclasses.replace(cfg, speculative=spec))}
    params = SamplingParams(max_tokens=args.max_tokens)
    seconds, tokens, outputs = {"plain": 0.0, "ngram": 0.0}, {"plain": 0, "ngram": 0}, {}
    for engine in engines.values():  # first runs, and the prefix cache filled alike
        engine.generate(prompts[:1], [params])
    for i, prompt in enumerate(prompts):
        for name in (("plain", "ngram") if i % 2 else ("ngram", "plain")):
            start = time.perf_counter()
            request = engines[name].generate([prompt], [params])[0]
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(request.output_ids)
            outputs.setdefault(i, []).append(request.output_ids)
    assert all(a == b for a, b in outputs.values()), "greedy outputs differ with speculation"
    stats = engines["ngram"].spec
    steps = stats.num_drafts + (tokens["ngram"] - stats.num_accepted_tokens - stats.num_drafts)  # verify + plain
    config = {"model": "SmolLM2-135M-Instruct Q4_1->f32", "prompts": len(prompts), "max_tokens": args.max_tokens,
              "num_tokens": args.tokens, "batch": 1, "cpu_threads": os.cpu_count()}
    rows = [record(args.out, "speculative_cpu", config, "acceptance_rate",
                   stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), ""),
            record(args.out, "speculative_cpu", config, "tokens_per_step", tokens["ngram"] / max(steps, 1), "tok",
                   "no speculation", 1.0),
            record(args.out, "speculative_cpu", config, "output_tokens_per_s", tokens["ngram"] / seconds["ngram"],
                   "tok/s", "no speculation, same run", tokens["plain"] / seconds["plain"])]
    print(json.dumps({"per_position_accepted": stats.accepted_per_position, "drafts": stats.num_drafts}))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
