"""A speculative verify step (the last token and k drafts per row, jaxserve.step.verify_step_fn and the verifier)
against a one-token decode step, both through the engine's StepRunner on the same state, at each batch and k + 1.

    PYTHONPATH=. python3 benchmarks/verify_gpu.py [--model random:llama3-8b] [--batches 1,8,32] [--widths 2,3,4,5,6,7,8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import dispatched_back_to_back, record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--widths", default="2,3,4,5,6,7,8", help="k + 1: the last token and k drafts")
    ap.add_argument("--context", type=int, default=1024, help="positions each row has cached")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--draft", default="random:llama3-1b", help="a draft model whose one-token step is timed too")
    ap.add_argument("--out", default="benchmarks/results/verify_gpu.jsonl")
    args = ap.parse_args()
    batches, widths = [int(b) for b in args.batches.split(",")], [int(w) for w in args.widths.split(",")]

    from jaxserve.config import EngineConfig, SpeculativeConfig
    from jaxserve.engine.batch import StepInput
    from jaxserve.launch import load_model
    from jaxserve.runner import VERIFIERS, StepRunner
    from jaxserve.step import verify_step_fn

    pages = -(-(args.context + max(widths)) // 16)
    cfg = EngineConfig(max_slots=max(batches), page_size=16, num_pages=max(batches) * pages, max_pages_per_slot=pages,
                       chunk_buckets=(16,), decode_row_buckets=tuple(batches),
                       speculative=SpeculativeConfig(method="ngram", num_tokens=max(widths) - 1))
    model = load_model(args.model, dtype="bfloat16", quantize=None, engine=cfg)
    runner = StepRunner(model, cfg)
    extra = {(r, w, pages) for r in batches for w in widths} - set(runner._verify_steps)
    step = functools.partial(verify_step_fn, cfg=runner.model_cfg, attention=cfg.attention)
    runner._verify_steps |= {key[1]: fn for key, fn in runner._compile({("verify", b): (step, b) for b in extra}, 0.0).items()}
    runner._verifiers |= {(r, False, False): VERIFIERS[False, False] for r in batches}

    def inputs(rows: int, width: int) -> StepInput:
        inp = StepInput.build([None] * rows, width, pages, cfg.max_slots)
        rng = np.random.default_rng(0)
        inp.tokens[:] = rng.integers(0, runner.model_cfg.vocab_size - 1, inp.tokens.shape)
        inp.slots[:], inp.valid[:], inp.prompt_len[:] = np.arange(rows), True, args.context
        inp.positions[:] = args.context + np.arange(width)
        inp.page_table[:] = np.arange(rows * pages).reshape(rows, pages)
        return inp

    draft = StepRunner(load_model(args.draft, dtype="bfloat16", quantize=None, engine=cfg), cfg) if args.draft else None
    for rows in batches:
        one = dispatched_back_to_back(runner, inputs(rows, 1), args.steps)[1]
        if draft is not None:  # a draft model's cost per proposed token: its one-token step
            seconds = dispatched_back_to_back(draft, inputs(rows, 1), args.steps)[1]
            print(json.dumps(record(args.out, "draft_step", {"model": args.draft, "target": args.model, "batch": rows,
                                                             "context": args.context}, "step_s", seconds, "s",
                                    "the target's one-token step, same run", one, higher_is_better=False)), flush=True)
        for width in widths:
            inp = inputs(rows, width)

            class Verify:  # the runner's verify dispatch, as dispatched_back_to_back calls it
                dispatch = staticmethod(lambda x: runner.dispatch(x, verify=True))

            seconds = dispatched_back_to_back(Verify, inp, args.steps)[1]
            row = record(args.out, "verify_step", {"model": args.model, "batch": rows, "width": width,
                                                   "context": args.context}, "step_s", seconds, "s",
                         "one-token decode step, same run", one, higher_is_better=False)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
