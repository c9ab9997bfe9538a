"""The optimized HLO of jaxserve's decode step for an 8B-shaped Llama cut to a few layers (every layer
compiles alike), with its fusions counted by kind: what XLA made of one layer, without a 32-layer compile.

    PYTHONPATH=. python3 benchmarks/step_hlo_gpu.py --layers 2 --batch 1 --variants bfloat16,int8 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.int8_gpu import LLAMA_8B, decode_step  # noqa: E402
from jaxserve.config import QuantConfig  # noqa: E402
from jaxserve.model.quant import quantize_weights  # noqa: E402
from jaxserve.model.weights import random_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--variants", default="bfloat16,int8")
    ap.add_argument("--out", default="/tmp/step_hlo")
    args = ap.parse_args()
    cfg = dataclasses.replace(LLAMA_8B, num_layers=args.layers)
    os.makedirs(args.out, exist_ok=True)
    bf16 = random_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    for variant in args.variants.split(","):
        weights = bf16 if variant == "bfloat16" else quantize_weights(bf16, QuantConfig(mode="int8"), jnp.bfloat16)
        text = decode_step(cfg, weights, args.batch, args.context)[0].as_text()
        path = os.path.join(args.out, f"decode_{variant}_b{args.batch}_{args.layers}layers.hlo.txt")
        with open(path, "w") as f:
            f.write(text)
        entry = text[text.rindex("ENTRY"):]
        ops = re.findall(r"^\s*(?:ROOT )?%?([\w\-]+?)(?:\.\d+)* = .*? (fusion|custom-call)\(", entry, re.M)
        kinds = collections.Counter(f"{kind}: {name}" for name, kind in ops)
        print(f"{variant}: {path}")
        for name, n in kinds.most_common():
            print(f"  {n:4d}  {name}")


if __name__ == "__main__":
    main()
