"""Load over loopback gRPC: N concurrent streaming clients, each figure against a baseline of the same run.

1. Output tokens/s of N concurrent streams over gRPC against the in-process engine (`run_bench`,
   same N, lengths and engine config): what the server costs.
2. The same against 1 streaming client over gRPC: what batching buys through the server.
3. Time to first token and inter-token latency, p50 and p99, as the clients see them, against the
   in-process engine's (TTFT p50/p99, ITL p50) and the single client's (ITL p99).

    .venv/bin/python benchmarks/grpc_load.py [--clients 32] [--input-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import record  # noqa: E402
from jaxserve.bench import percentile  # noqa: E402


def run_clients(address: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """One streaming client per prompt, all at once; latencies measured where the client reads them."""
    from jaxserve.client import Client

    ttft: list[float] = []
    itl: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    start_line = threading.Barrier(len(prompts) + 1)

    def one(prompt: list[int]) -> None:
        with Client(address) as client:
            start_line.wait()
            start = last = time.perf_counter()
            gaps, first, count = [], None, 0
            for response in client.generate(token_ids=prompt, max_tokens=output_len, ignore_eos=True):
                if response.HasField("chunk") and response.chunk.token_ids:
                    now = time.perf_counter()
                    if first is None:
                        first = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    count += len(response.chunk.token_ids)
        assert count == output_len, f"a stream got {count} tokens, not {output_len}"
        with lock:
            ttft.append(first or 0.0)
            itl.extend(gaps)
            tokens[0] += count

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    start_line.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"output_tokens_per_s": tokens[0] / wall, "wall_s": wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": percentile(ttft, 0.99), "itl_p50_s": statistics.median(itl), "itl_p99_s": percentile(itl, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bfloat16 elsewhere)")
    ap.add_argument("--out", default="benchmarks/results/grpc_load.jsonl")
    args = ap.parse_args()

    import jax

    from jaxserve.bench import bench_config, run_bench
    from jaxserve.checkpoint import load_model
    from jaxserve.config import ServerConfig
    from jaxserve.server.server import Server, model_info
    from jaxserve.step import build_engine

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    model = load_model(None, dtype=dtype)
    n, input_len, output_len = args.clients, args.input_len, args.output_len
    engine_cfg = bench_config(n, input_len, output_len)

    in_process = run_bench(model, n, input_len, output_len, engine_cfg)

    engine = build_engine(model, engine_cfg)
    engine.start()
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=None, engine=engine_cfg, max_tokens_limit=output_len)
    server = Server(cfg)
    server.start()
    server.attach(engine, model_info(model, engine, cfg, dtype=dtype))
    address = f"127.0.0.1:{server.port}"
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(input_len)] for _ in range(n)]
    try:
        run_clients(address, prompts[:1], 2)  # first-run effects
        single = run_clients(address, prompts[:1], output_len)
        many = run_clients(address, prompts, output_len)
    finally:
        server.drain(5)
        server.stop()
        engine.stop()

    config = {"model": f"SmolLM2-135M-Instruct Q4_1->{dtype}", "clients": n, "input_len": input_len,
              "output_len": output_len, "max_slots": engine_cfg.max_slots, "transport": "gRPC over loopback",
              "cpu_threads": os.cpu_count(), "wall_s": many["wall_s"]}
    name = f"grpc_load_{n}clients_{input_len}in_{output_len}out"
    rows = [
        record(args.out, name, config, "output_tokens_per_s", many["output_tokens_per_s"], "tok/s",
               f"in-process engine, {n} requests", in_process["output_tokens_per_s"]),
        record(args.out, name, config, "output_tokens_per_s", many["output_tokens_per_s"], "tok/s",
               "1 gRPC client", single["output_tokens_per_s"]),
        record(args.out, name, config, "ttft_p50_s", many["ttft_p50_s"], "s", f"in-process engine, {n} requests",
               in_process["ttft_p50_s"], higher_is_better=False),
        record(args.out, name, config, "ttft_p99_s", many["ttft_p99_s"], "s", f"in-process engine, {n} requests",
               in_process["ttft_p99_s"], higher_is_better=False),
        record(args.out, name, config, "itl_p50_s", many["itl_p50_s"], "s", f"in-process engine, {n} requests",
               in_process["itl_p50_s"], higher_is_better=False),
        record(args.out, name, config, "itl_p99_s", many["itl_p99_s"], "s", "1 gRPC client", single["itl_p99_s"],
               higher_is_better=False),
    ]
    print(f"{'metric':<22}{'gRPC':>12}{'baseline':>12}{'ratio':>8}  baseline")
    for r in rows:
        print(f"{r['metric']:<22}{r['value']:>12.4f}{r['baseline_value']:>12.4f}{r['ratio']:>8.2f}  {r['baseline']}")


if __name__ == "__main__":
    main()
