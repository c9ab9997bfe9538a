"""The offline load (256 x 1,000 in / 1,000 out) through the real engine and scheduler with a null runner, every
dispatch costed by a roofline model of the 8B step on an H100. A prediction, not a measurement: it says what a
scheduling or memory change can buy before a GPU run measures it.

The model: a decode dispatch costs the larger of streaming the weights and the rows' matmul FLOPs, plus its rows'
K/V bytes at the copy bandwidth, plus a fixed 1.2 ms of small kernels; a prefill dispatch costs its tokens' matmul
FLOPs. With the defaults it gives 24.8 ms for the 256-row step at 1,500 tokens (measured alone: 24.5 ms) and 47 ms
for a 2,048-token prefill (measured for 2,000 tokens: 50 ms). The null runner samples token 5 for every row.

    .venv/bin/python benchmarks/offline_model.py [--num-pages 26621] [--kv-bytes 131072] [--chunk 512]
        [--prefill-tokens 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WEIGHT_BYTES = 15.0e9  # the 8B model's weights read per step (bf16, without the embedding table)
PARAMS = 7.5e9  # parameters in the step's matrix products
COPY_BW = 2.85e12  # B/s, the device copy (results/kernels_gpu.jsonl)
MATMUL_FLOPS = 650e12  # FLOP/s, the bf16 matmul rate of the prefill step (docs/performance.md)
SMALL_S = 1.2e-3  # norms, RoPE, K/V writes, sampling: per decode step


def replay(num_pages: int, chunk: int, prefill_tokens: int, requests: int = 256, input_len: int = 1000,
           output_len: int = 1000, slots: int = 256) -> tuple[list[tuple[int, int, int, int]], object]:
    """[(rows, width, valid rows, summed context of the valid rows)] per dispatch, and the engine's stats."""
    from jaxserve.bench import bench_config
    from jaxserve.checkpoint.random_model import preset, synthetic_tokenizer
    from jaxserve.config import SamplingParams
    from jaxserve.engine.batch import NUM_TOP, StepOutput
    from jaxserve.engine.engine import Engine

    log: list[tuple[int, int, int, int]] = []

    class NullRunner:
        def dispatch(self, inp):
            rows, width, _ = inp.shape
            live = inp.valid.any(axis=1)
            log.append((rows, width, int(live.sum()), int((inp.positions.max(axis=1) * live).sum())))
            packed = np.zeros((rows, 2 + 2 * NUM_TOP), np.float32)
            packed[:, 0], packed[:, 1] = 5, -1.0
            return lambda: StepOutput.unpack(packed)

    mc = preset("random:llama3-8b")
    cfg = bench_config(requests, input_len, output_len, max_slots=slots, chunk_buckets=(chunk,),
                       prefill_rows=(1, 2, 4, 8), prefill_tokens=prefill_tokens)
    cfg = dataclasses.replace(cfg, num_pages=num_pages, decode_page_buckets=(), decode_row_buckets=(slots,))
    engine = Engine(NullRunner(), synthetic_tokenizer(mc.vocab_size), cfg, vocab_size=mc.vocab_size,
                    context_len=mc.max_position_embeddings)
    rng = random.Random(0)
    prompts = [[rng.randrange(mc.vocab_size - 1) for _ in range(input_len)] for _ in range(requests)]
    engine.generate(prompts, [SamplingParams(max_tokens=output_len, ignore_eos=True)] * requests)
    return log, engine


def cost(log, kv_bytes_per_token: int, kv_fraction: float = 1.0) -> tuple[float, float]:
    """(decode seconds, prefill seconds) of the dispatches under the model; the attention kernel streams K/V at
    `kv_fraction` of the copy bandwidth."""
    decode = prefill = 0.0
    for rows, width, _, context in log:
        if width == 1:
            decode += max(WEIGHT_BYTES / COPY_BW, 2 * PARAMS * rows / MATMUL_FLOPS) + \
                context * kv_bytes_per_token / (kv_fraction * COPY_BW) + SMALL_S
        else:
            prefill += rows * width * 2 * PARAMS / MATMUL_FLOPS
    return decode, prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-pages", type=int, default=26621, help="the pool kv_memory_fraction 0.9 gave on the H100")
    ap.add_argument("--kv-bytes", type=int, default=131072, help="K/V bytes per token (8B, bf16: 131,072)")
    ap.add_argument("--kv-fraction", type=float, default=1.0,
                    help="the decode kernel's K/V bandwidth over the copy's: bf16 pages about 1 (0.96-0.98), float8 pages "
                         "0.54 with the compute warpgroup converting, 0.67 with the converting warpgroup "
                         "(fp8_decode_gpu.py)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    args = ap.parse_args()
    log, engine = replay(args.num_pages, args.chunk, args.prefill_tokens)
    decode, prefill = cost(log, args.kv_bytes, args.kv_fraction)
    rows = [live for _, width, live, _ in log if width == 1]
    print(f"{args.num_pages} pages, {args.kv_bytes} K/V bytes a token: {engine.stats.steps} steps, "
          f"{engine.scheduler.num_preemptions} preemptions, decode rows p10/p50 {np.percentile(rows, 10):.0f}/"
          f"{np.percentile(rows, 50):.0f}; model {decode + prefill:.1f} s (decode {decode:.1f}, prefill {prefill:.1f}) "
          f"= {256_000 / (decode + prefill):,.0f} output tok/s")


if __name__ == "__main__":
    main()
