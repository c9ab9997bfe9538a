"""Serving figures of an 8B-shaped Llama on one GPU, each against a baseline from the same run.

1. Offline throughput: N requests of I tokens in and O out, all submitted at once, through the engine,
   with as many slots as the device's free memory holds. The peer is Hugging Face `transformers`
   `generate` on the same GPU, model shape, lengths and requests, in batches of --peer-batch.
2. Throughput and latency percentiles against concurrency: C requests at once for each C in --concurrency.
   Parts 1 and 2 run through one engine, sized for the offline load and compiled once.
3. Time to first token of one --ttft-len prompt on an idle engine, against its compute floor: the
   prompt's matrix-product FLOPs (weights and causal attention) at the bf16 matmul rate measured here.

    PYTHONPATH=. python3 benchmarks/serving_gpu.py [--requests 256 --input-len 1000 --output-len 1000]
    .venv/bin/python benchmarks/serving_gpu.py --smoke        # random:smoke on CPU, tiny lengths

Rows go to benchmarks/results/serving_gpu.jsonl (smoke: /tmp).
On one 10-minute device call the parts may not all fit (an 8B step compiles once per bucket): split them
with --parts (e.g. `--parts offline,concurrency`, then `--parts peer,ttft`); the compilation cache
(--cache-dir) carries over on a warm machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import decode_input, dispatched_back_to_back, print_rows, record, timed  # noqa: E402

PARTS = {"offline", "peer", "concurrency", "ttft"}


def matmul_rate(dtype) -> float:
    """bf16 dense matrix-product FLOP/s of this device (8192³ on a GPU, 1024³ elsewhere)."""
    import jax

    n = 8192 if jax.default_backend() == "gpu" else 1024
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / timed(f, a, inner=5)


def prefill_flops(cfg, tokens: int) -> float:
    """Matrix-product FLOPs of one prompt: 2 per weight per token (output head for the last token only)
    plus causal attention, 2 products of tokens²/2 · head_dim per head."""
    d, f, h, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * (h + 2 * kv) * hd + h * hd * d + 3 * d * f
    weights = 2 * tokens * cfg.num_layers * per_layer + 2 * d * cfg.vocab_size
    attention = cfg.num_layers * h * 2 * 2 * (tokens * tokens / 2) * hd
    return weights + attention


def slots_that_fit(cfg, pages_per_slot: int, page_size: int, itemsize: int, wanted: int, reserve: float) -> int:
    """Slots whose KV pages fit at full length in the device's memory limit beside what is in use, leaving
    `reserve` of the limit for activations: the engine's own sizing (`kv_memory_fraction` = 1 - reserve)."""
    import gc

    import jax

    from jaxserve.runner import pages_in_memory

    gc.collect()  # the previous engine's KV pages, if nothing holds them any more
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:  # CPU: no limit to size from
        return wanted
    page_bytes = page_size * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    pages = pages_in_memory([stats], 1 - reserve, page_bytes, 1, reserved=1, at_least=pages_per_slot)
    return min(wanted, pages // pages_per_slot)


def engine_config(model, requests: int, input_len: int, output_len: int, reserve: float, chunk: int,
                  prefill_tokens: int, decode_rows: tuple[int, ...] = (), cache_dir: str | None = None,
                  memory_fraction: float = 0.0, kv_cache_dtype: str = "auto",
                  prefill_rows: tuple[int, ...] = (1, 2, 4, 8)):
    """`jaxserve bench`'s engine for the load, one prefill chunk width and the decode row counts the loads will
    use; compilations go to a persistent cache. Slots: as many as free memory holds at their full length or,
    with `memory_fraction`, one per request (up to 256) over the pages the engine sizes from memory
    (kv_memory_fraction), so that requests are preempted when the pages run out."""
    import dataclasses

    from jaxserve.bench import bench_config
    from jaxserve.model.kv_cache import page_dtype

    cfg = bench_config(requests, input_len, output_len, max_slots=min(requests, 256), chunk_buckets=(chunk,),
                       prefill_rows=prefill_rows, prefill_tokens=prefill_tokens)
    itemsize = page_dtype(kv_cache_dtype, model.weights.final_norm.dtype).itemsize  # of a KV page value
    if memory_fraction:  # every slot wanted; the engine sizes the pages
        slots = cfg.max_slots
    else:
        slots = slots_that_fit(model.config, cfg.max_pages_per_slot, cfg.page_size, itemsize, cfg.max_slots, reserve)
    # One decode page width: the Pallas decode kernel reads each row's own length whatever the table's width
    # (narrower widths only help XLA's attention, which gathers the whole table), and each width is another
    # compile of every decode row count (about 100 s for an 8B bucket).
    return dataclasses.replace(cfg, max_slots=slots, num_pages=slots * cfg.max_pages_per_slot, decode_page_buckets=(),
                               kv_memory_fraction=memory_fraction, kv_cache_dtype=kv_cache_dtype,
                               prefill_rows=tuple(r for r in cfg.prefill_rows if r <= slots),
                               decode_row_buckets=tuple(sorted({r for r in decode_rows if 0 < r < slots} | {slots})),
                               compilation_cache_dir=cache_dir)


def decode_step_alone(engine, context: int, steps: int = 20) -> float:
    """Seconds per decode step of the engine's widest bucket (every slot at `context`), dispatched back to back
    with no scheduling between: what the load's inter-token latency would be with no host work at all."""
    cfg = engine.cfg
    inp = decode_input(cfg.max_slots, context, cfg.max_pages_per_slot, engine.vocab_size)
    return dispatched_back_to_back(engine.runner, inp, steps)[1]


def peer_throughput(cfg, requests: int, input_len: int, output_len: int, batch: int, seed: int = 0) -> float:
    """Output tokens/s of transformers' greedy `generate`, out of the box, on the same shape (random weights,
    bf16), after one warm-up call."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                     max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                     tie_word_embeddings=cfg.tie_word_embeddings)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    with torch.device(device):  # built in place, in its dtype: no float32 copy on the host
        model = LlamaForCausalLM(hf).eval()
    rng = np.random.default_rng(seed)
    prompts = torch.as_tensor(rng.integers(0, cfg.vocab_size - 1, (requests, input_len)), device=device)
    with torch.inference_mode():
        model.generate(prompts[:1], attention_mask=torch.ones_like(prompts[:1]), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)  # warm-up, not counted: kernels load and autotune
        done, start = 0, time.perf_counter()
        for i in range(0, requests, batch):
            ids = prompts[i:i + batch]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            done += (out.shape[1] - input_len) * ids.shape[0]
    if device == "cuda":
        torch.cuda.synchronize()
    return done / (time.perf_counter() - start)  # (its own process: the model goes with it)


def peer_in_subprocess(args: argparse.Namespace) -> float:
    """Runs the peer in its own process before this one touches the device: JAX keeps most of the GPU's
    memory in its own pool once it starts, and the engine's weights stay alive for the later parts."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--peer-only", "--model", args.model,
           "--peer-requests", str(args.peer_requests), "--peer-batch", str(args.peer_batch),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the transformers peer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["output_tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--parts", default=",".join(sorted(PARTS)), help="which figures: offline, peer (transformers on "
                    "--peer-requests of the load, and the engine on the same), concurrency, ttft")
    ap.add_argument("--concurrency", default="1,16,64,256", help="requests at once for part 2")
    ap.add_argument("--ttft-len", type=int, default=2000)
    ap.add_argument("--peer-requests", type=int, default=64, help="requests run through transformers (0 skips)")
    ap.add_argument("--peer-batch", type=int, default=64)
    ap.add_argument("--reserve", type=float, default=0.1,
                    help="share of the device's memory limit left for activations (slots at full length)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float8_e4m3fn"),
                    help="the KV pages' dtype (float8_e4m3fn: twice the pages in the same memory)")
    ap.add_argument("--kv-memory-fraction", type=float, default=0.0,
                    help="parts 1-2: a slot per request (up to 256) and KV pages sized by the engine from this share "
                         "of device memory (preempting when they run out); 0: slots that fit at full length")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefill-rows", default="1,2,4,8",
                    help="parts 1-2: prefill row buckets, from 1, up to prefill-tokens / chunk (each is a compile "
                         "of the 8B step, ~100-160 s; with fewer, prompts are padded to the next bucket: at the "
                         "defaults 1,4 saves one compile)")
    ap.add_argument("--cache-dir", default=".jax_cache", help="persistent compilation cache (git-ignored; a warm "
                    "GPU machine keeps it between calls, so the parts can run in separate calls)")
    ap.add_argument("--smoke", action="store_true", help="random:smoke, tiny lengths, CPU")
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)  # the subprocess of the peer
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.requests, args.input_len, args.output_len = "random:smoke", 8, 24, 8
        args.concurrency, args.ttft_len, args.peer_requests, args.peer_batch = "1,8", 64, 4, 4
        args.chunk, args.prefill_tokens = 32, 64
    out = args.out or ("/tmp/serving_smoke.jsonl" if args.smoke else "benchmarks/results/serving_gpu.jsonl")
    if args.peer_only:
        import json

        from jaxserve.checkpoint.random_model import preset

        tps = peer_throughput(preset(args.model), args.peer_requests, args.input_len, args.output_len, args.peer_batch)
        print(json.dumps({"output_tokens_per_s": tps}))
        return
    parts = set(args.parts.split(",")) - {""}
    if parts - PARTS:
        raise SystemExit(f"--parts {args.parts!r}: unknown {sorted(parts - PARTS)}; choose from {sorted(PARTS)}")
    if "peer" in parts and args.peer_requests % min(args.peer_batch, args.peer_requests):
        raise SystemExit(f"--peer-requests {args.peer_requests} must be a multiple of --peer-batch {args.peer_batch}: "
                         "a partial last batch would understate the peer's rate")
    peer = peer_in_subprocess(args) if "peer" in parts and args.peer_requests else None

    import jax
    import jax.numpy as jnp

    from jaxserve.bench import run_load
    from jaxserve.checkpoint import load_model
    from jaxserve.runner import build_engine

    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    model = load_model(args.model, dtype=dtype)
    cfg = model.config
    print(f"{jax.devices()[0]} jax {jax.__version__}; {args.model}", flush=True)
    rows = []
    base = {"model": args.model, "dtype": jnp.dtype(dtype).name}
    seeds = itertools.count()  # one per load: an engine's prefix cache would serve a repeated prompt

    def load(engine, requests: int, input_len: int, output_len: int) -> dict:
        result = run_load(engine, requests, input_len, output_len, seed=next(seeds))
        print(f"  {requests} x {input_len}/{output_len} on {engine.cfg.max_slots} slots: "
              f"{result['output_tokens_per_s']:.0f} tok/s, TTFT p50 {result['ttft_p50_s'] * 1e3:.0f} ms, ITL p50 "
              f"{result['itl_p50_s'] * 1e3:.1f} ms, " + ", ".join(f"{k} {v:.0%}" for k, v in result.items()
                                                                  if k.endswith("_fraction")), flush=True)
        return result

    def build(ecfg):
        start = time.perf_counter()
        engine = build_engine(model, ecfg)
        print(f"  engine of {engine.cfg.max_slots} slots, {engine.cfg.num_pages} pages: {engine.runner.buckets} "
              f"compiled and run once in {time.perf_counter() - start:.0f} s", flush=True)
        return engine

    def details(r: dict) -> dict:
        return {**base, "kv_memory_fraction": args.kv_memory_fraction, "kv_cache_dtype": args.kv_cache_dtype,
                "chunk": args.chunk, "prefill_tokens": args.prefill_tokens, "prefill_rows": args.prefill_rows,
                **{k: r[k] for k in ("requests", "input_len", "output_len", "max_slots", "wall_s",
                                             "ttft_p50_s", "itl_p50_s", "preemptions", "engine_steps",
                                             "decode_step_alone_s") if k in r},
                **{k: v for k, v in r.items() if k.endswith("_fraction")}}

    # 1 and 2 run through one engine sized for the offline load, compiled once.
    concurrency = [int(x) for x in args.concurrency.split(",") if x] if "concurrency" in parts else []
    if {"offline", "concurrency"} & parts or peer is not None:
        engine = build(engine_config(model, args.requests, args.input_len, args.output_len, args.reserve, args.chunk,
                                     args.prefill_tokens, tuple(concurrency) + (args.peer_requests,), args.cache_dir,
                                     args.kv_memory_fraction, args.kv_cache_dtype,
                                     tuple(int(r) for r in args.prefill_rows.split(","))))
        runs: dict[int, dict] = {}

        def at(requests: int) -> dict:
            if requests not in runs:
                runs[requests] = load(engine, requests, args.input_len, args.output_len)
            return runs[requests]

        if peer is not None:  # the peer's slice of the load, through the engine
            same = at(args.peer_requests)
            rows.append(record(out, "offline_throughput_vs_transformers", {**details(same), "peer_batch": args.peer_batch,
                               "peer": "transformers generate out of the box, greedy, same GPU, own process"},
                               "output_tokens_per_s", same["output_tokens_per_s"], "tok/s", "transformers", peer))
        if "offline" in parts:
            ours = at(args.requests)
            ours["decode_step_alone_s"] = decode_step_alone(engine, args.input_len + args.output_len // 2)
            rows.append(record(out, "offline_throughput", details(ours), "output_tokens_per_s",
                               ours["output_tokens_per_s"], "tok/s"))
            if peer is not None:  # the whole load against the peer's rate: it runs any load batch after batch
                batch = min(args.peer_batch, args.peer_requests)
                rows.append(record(out, "offline_throughput_vs_transformers_rate",
                             {**details(ours), "peer_batch": batch, "peer_requests": args.peer_requests,
                              "peer": f"transformers generate out of the box, greedy, same GPU, own process, timed on "
                                      f"{args.peer_requests} of the requests in batches of {batch}; its rate on the "
                                      f"whole load in such batches is the same; ours runs up to {engine.cfg.max_slots} "
                                      f"at once"},
                             "output_tokens_per_s", ours["output_tokens_per_s"], "tok/s", "transformers", peer))
        for c in concurrency:
            r = at(c)
            lat = {k: r[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "itl_p99_s")}
            rows.append(record(out, "throughput_vs_concurrency", {**base, "concurrency": c, "input_len": args.input_len,
                               "output_len": args.output_len, "max_slots": r["max_slots"], **lat},
                               "output_tokens_per_s", r["output_tokens_per_s"], "tok/s"))
        del engine, runs

    # 3. time to first token alone against its compute floor (one chunk holds the whole prompt; median of 3)
    if "ttft" in parts:
        whole = -(-args.ttft_len // 16) * 16
        engine = build(engine_config(model, 1, args.ttft_len, 1, args.reserve, whole, whole, (), args.cache_dir))
        ttfts = [load(engine, 1, args.ttft_len, 1)["ttft_p50_s"] for _ in range(3)]
        del engine
        ttft = sorted(ttfts)[1]
        floor = prefill_flops(cfg, args.ttft_len) / matmul_rate(dtype)
        rows.append(record(out, "ttft_vs_compute_floor", {**base, "prompt_len": args.ttft_len, "runs_s": ttfts,
                           "ttft_over_floor": ttft / floor}, "ttft_s", ttft, "s", "compute_floor", floor,
                           higher_is_better=False))
    print_rows(rows, ("concurrency", "requests"))


if __name__ == "__main__":
    main()
