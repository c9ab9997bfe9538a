"""The new families' shapes on the GPU through `jaxserve bench` (random weights, bfloat16): batch-1 decode against
its bandwidth floor (the bytes a step reads, of a mixture only its routed experts, over a device copy's rate
measured in the same run), and output tokens/s of 64 concurrent requests against batch 1.

    PYTHONPATH=. python3 benchmarks/families_gpu.py [--models random:qwen3-8b,random:gemma3-12b,random:qwen3-30b-a3b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402


def bench(model: str, requests: int, output_len: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "--model", model, "--dtype", "bfloat16",
                           "--num-requests", str(requests), "--input-len", "512", "--output-len", str(output_len),
                           "--json"], capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"jaxserve bench failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="random:qwen3-8b,random:gemma3-12b,random:qwen3-30b-a3b")
    ap.add_argument("--out", default="benchmarks/results/families_gpu.jsonl")
    args = ap.parse_args()
    results = {}
    for model in args.models.split(","):  # first, each in a process of its own with the whole GPU
        results[model] = bench(model, 1, 128), bench(model, 64, 128)
        print(model, json.dumps(results[model]), flush=True)
    from benchmarks.kernels_gpu import copy_bandwidth
    from jaxserve.checkpoint import load_model
    from jaxserve.model.quant import decode_weight_bytes

    rate = copy_bandwidth()
    print(f"device copy: {rate / 1e12:.3f} TB/s", flush=True)
    for model, (one, many) in results.items():
        loaded = load_model(model, dtype="bfloat16")
        floor = decode_weight_bytes(loaded.weights, loaded.config.experts_per_token) / rate
        del loaded
        config = {"model": model, "dtype": "bfloat16", "input_len": 512, "output_len": 128}
        for row in (record(args.out, "families_decode", {**config, "batch": 1}, "itl_p50_s", one["itl_p50_s"], "s",
                           "bandwidth floor (weights read, routed experts only, over a device copy's rate)", floor,
                           higher_is_better=False),
                    record(args.out, "families_throughput", {**config, "requests": 64}, "output_tokens_per_s",
                           many["output_tokens_per_s"], "tok/s", "batch 1", one["output_tokens_per_s"])):
            print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
