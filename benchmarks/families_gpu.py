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
# this process touches the GPU only to name it in the rows: it must not take the memory the benches need
_BENCH_ENV = dict(os.environ)
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
from benchmarks.common import cli_bench, record  # noqa: E402


def bench(model: str, requests: int, output_len: int) -> dict:
    return cli_bench(["--model", model, "--dtype", "bfloat16", "--num-requests", str(requests), "--input-len", "512",
                      "--output-len", str(output_len)], _BENCH_ENV, timeout=900)


def copy_rate() -> float:
    """A device copy's bytes/s, in a process of its own (this one keeps the GPU free for the benches')."""
    done = subprocess.run([sys.executable, "-c", "from benchmarks.kernels_gpu import copy_bandwidth; "
                           "print(copy_bandwidth())"], capture_output=True, text=True, timeout=300, check=True,
                          env=_BENCH_ENV)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="random:qwen3-8b,random:gemma3-12b,random:qwen3-30b-a3b")
    ap.add_argument("--out", default="benchmarks/results/families_gpu.jsonl")
    args = ap.parse_args()
    rate = copy_rate()
    print(f"device copy: {rate / 1e12:.3f} TB/s", flush=True)
    for model in args.models.split(","):  # each bench in a process of its own with the whole GPU
        one, many = bench(model, 1, 128), bench(model, 64, 128)
        floor = one["decode_weight_bytes"] / rate
        config = {"model": model, "dtype": "bfloat16", "input_len": 512, "output_len": 128}
        for row in (record(args.out, "families_decode", {**config, "batch": 1}, "itl_p50_s", one["itl_p50_s"], "s",
                           "bandwidth floor (weights read, routed experts only, over a device copy's rate)", floor,
                           higher_is_better=False),
                    record(args.out, "families_throughput", {**config, "requests": 64}, "output_tokens_per_s",
                           many["output_tokens_per_s"], "tok/s", "batch 1", one["output_tokens_per_s"])):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
