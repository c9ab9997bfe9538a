"""Offline load through the engine: N random prompts of fixed length, fixed output length."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from typing import Any

import numpy as np

from jaxserve import launch
from jaxserve.checkpoint import LoadedModel
from jaxserve.config import EngineConfig, ParallelConfig, SamplingParams, chunks_for, sequence_parallel_chunks
from jaxserve.engine.engine import Engine
from jaxserve.runner import release_followers


def bench_config(num_requests: int, input_len: int, output_len: int, *, max_slots: int | None = None,
                 page_size: int = 16, chunk_buckets: tuple[int, ...] = (32, 128, 256),
                 prefill_rows: tuple[int, ...] = (1, 2, 8), prefill_tokens: int | None = None,
                 attention: str = "auto", parallel: ParallelConfig | None = None) -> EngineConfig:
    """Slots and pages for the load. Only the buckets the load can use are compiled: decode page tables
    from the first width that holds a prompt and its first token, each at most 1.25x the last (XLA's
    attention reads the whole table, so its cost follows the width), decode rows of half the slots and
    all of them (the load's requests start and end together; fewer rows pad to half), chunks up to the
    first that holds a prompt, prefill rows up to the number of requests. One step prefills up to
    `prefill_tokens` (default: the largest of `chunk_buckets`, whichever widths are compiled)."""
    parallel = parallel or ParallelConfig()
    slots = max_slots or min(num_requests, 64)
    chunk_buckets = sequence_parallel_chunks(chunk_buckets, parallel.sp)
    budget = prefill_tokens or max(chunk_buckets)
    chunk_buckets = chunks_for(chunk_buckets, input_len)
    prefill_rows = tuple(r for r in prefill_rows if r == 1 or r <= min(num_requests, slots))
    pages_per_slot = -(-(input_len + output_len) // page_size)
    pages_per_slot = -(-pages_per_slot // parallel.sp) * parallel.sp
    prompt_pages = -(-(input_len + 1) // page_size)  # every decode row holds at least this many
    return EngineConfig(max_slots=slots, page_size=page_size, num_pages=slots * pages_per_slot,
                        max_pages_per_slot=pages_per_slot, chunk_buckets=chunk_buckets,
                        prefill_rows=prefill_rows, prefill_tokens=budget, attention=attention,
                        decode_page_buckets=_geometric(min(prompt_pages, pages_per_slot), pages_per_slot, 1.25),
                        decode_row_buckets=(max(1, slots // 2),), parallel=parallel)


def _geometric(low: int, high: int, ratio: float) -> tuple[int, ...]:
    """Widths from `low` to `high`, each the larger of the last plus one and the last times `ratio`, rounded up."""
    widths = [low]
    while widths[-1] < high:
        widths.append(min(high, max(widths[-1] + 1, math.ceil(widths[-1] * ratio))))
    return tuple(widths)


def run_bench(model: LoadedModel, num_requests: int, input_len: int, output_len: int,
              cfg: EngineConfig | None = None, seed: int = 0, params: SamplingParams | None = None,
              constrained: SamplingParams | None = None, rounds: int = 1) -> dict[str, Any] | None:
    """Builds an engine for the load, then runs it (`run_load`); adds the build's seconds as compile_s. With
    `constrained`, runs `run_pair` instead. A follower of a multi-host group runs the leader's steps instead and gets
    None."""
    cfg = cfg or bench_config(num_requests, input_len, output_len)
    compile_start = time.perf_counter()
    engine = launch.engine_or_follow(model, cfg)
    if engine is None:
        return None
    compile_s = time.perf_counter() - compile_start
    from jaxserve.model.quant import decode_weight_bytes

    # what one row's decode step must read (of a mixture, only the experts it is routed to): the bandwidth floor's
    # numerator
    built = {"compile_s": compile_s,
             "decode_weight_bytes": decode_weight_bytes(model.weights, model.config.experts_per_token)}
    try:
        if constrained is not None:
            return {**run_pair(engine, num_requests, input_len, output_len, params, constrained, rounds), **built}
        return {**run_load(engine, num_requests, input_len, output_len, seed, params), **built}
    finally:
        release_followers(engine)


def run_pair(engine: Engine, num_requests: int, input_len: int, output_len: int, params: SamplingParams | None,
             constrained: SamplingParams, rounds: int) -> dict[str, Any]:
    """The load with `params` and with `constrained` (the same with a grammar), alternating for `rounds` rounds on
    one engine, so that the machine's other load falls on both alike: each one's run of median output tokens/s,
    and the ratio of those."""
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    for r in range(rounds):
        for i, (name, p) in enumerate((("unconstrained", params), ("constrained", constrained))):
            runs[name].append(run_load(engine, num_requests, input_len, output_len, 2 * r + i, p))
    median = {name: sorted(rs, key=lambda x: x["output_tokens_per_s"])[len(rs) // 2] for name, rs in runs.items()}
    ratio = median["constrained"]["output_tokens_per_s"] / median["unconstrained"]["output_tokens_per_s"]
    return {**median, "rounds": rounds, "constrained_over_unconstrained": ratio}


def run_load(engine: Engine, num_requests: int, input_len: int, output_len: int, seed: int = 0,
             params: SamplingParams | None = None) -> dict[str, Any]:
    """Submits `num_requests` random prompts at once to a built engine and runs them to completion; returns
    throughput and latencies. An engine runs several loads in turn: give each its own seed, or the prefix
    cache serves the prompts of the last one. `params`: every request's sampling (default greedy; max_tokens is
    output_len and the end of sequence is ignored either way)."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num_requests)]
    params = dataclasses.replace(params or SamplingParams(), max_tokens=output_len, ignore_eos=True)
    preempted, before = engine.scheduler.num_preemptions, dataclasses.replace(engine.stats)
    start = time.perf_counter()
    requests = engine.generate(prompts, [params] * num_requests)
    wall = time.perf_counter() - start
    ttft = [r.token_times[0] - r.submitted_at for r in requests]
    itl = [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])]
    output_tokens = sum(len(r.output_ids) for r in requests)
    return {
        "requests": num_requests, "input_len": input_len, "output_len": output_len,
        "output_tokens": output_tokens, "wall_s": wall, "output_tokens_per_s": output_tokens / wall,
        "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": percentile(ttft, 0.90),
        "ttft_p99_s": percentile(ttft, 0.99), "itl_p50_s": statistics.median(itl) if itl else 0.0,
        "itl_p90_s": percentile(itl, 0.90), "itl_p99_s": percentile(itl, 0.99),
        "preemptions": engine.scheduler.num_preemptions - preempted,
        "engine_steps": engine.stats.steps - before.steps, "max_slots": engine.cfg.max_slots,
        # the share of the wall time the engine thread waited on the device; the rest is host work that the
        # device overlaps only while a dispatched step is still running
        "device_wait_fraction": (engine.stats.device_wait_s - before.device_wait_s) / wall,
        # and the host work by part, as shares of the wall time
        **{f"{part}_fraction": (getattr(engine.stats, f"{part}_s") - getattr(before, f"{part}_s")) / wall
           for part in ("schedule", "dispatch", "commit")},
        # constrained requests (SamplingParams.grammar): the host's time computing a step's masks, per step that had
        # some (jaxserve.engine.grammar)
        "masked_steps": engine.stats.masked_steps - before.masked_steps,
        "mask_ms_per_step": 1e3 * (engine.stats.mask_s - before.mask_s) / max(1, engine.stats.masked_steps
                                                                               - before.masked_steps),
    }


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of `values`; 0 for no values."""
    return float(np.quantile(values, q, method="nearest")) if values else 0.0
