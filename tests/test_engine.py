"""The engine: batching, preemption, prefix sharing, chunking, compilation.

Tests whose assertions hold for any model (scheduling, pages, compilation, batch-independence) run a
small random-weight Llama with the embedded model's tokenizer and vocabulary, which keeps the suite
fast; those that check text run the embedded model.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import pytest

from jaxserve.checkpoint import LoadedModel
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.errors import JaxserveError
from jaxserve.model.config import ModelConfig
from jaxserve.model.weights import random_weights
from jaxserve.runner import build_engine, compilation_count
from tests.helpers import SERVING_ENGINE

pytestmark = pytest.mark.slow


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def small(smollm):
    """Two layers of random weights over the embedded model's vocabulary, GQA 4:2, 2k+ positions."""
    cfg = ModelConfig(vocab_size=smollm.config.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)
    return LoadedModel(cfg, random_weights(cfg, jax.random.key(7)), smollm.tokenizer, "small-random")


@pytest.fixture(scope="module")
def alone_small(small):
    return build_engine(small, EngineConfig(max_slots=1, page_size=16, num_pages=8, max_pages_per_slot=8,
                                            chunk_buckets=(16, 64)))


@pytest.fixture(scope="module")
def embedded_engine(smollm):
    """The embedded model in the serving modules' engine config, whose steps the session compiles once."""
    return build_engine(smollm, SERVING_ENGINE)


def test_64_requests_through_a_small_pool_match_running_alone(small, alone_small):
    """Preemption, recomputation and one-step-ahead planning leave every output as if run alone,
    including requests that stop on a token while their next step is already dispatched."""
    prompts = random_prompts(64, 3, 60)
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in prompts]
    alone = [r.output_ids for r in alone_small.generate(prompts, params)]
    assert alone_small.scheduler.num_preemptions == 0
    expected = list(alone)
    for i in range(0, 64, 3):  # every third request stops on a token it reaches midway
        stop = alone[i][len(alone[i]) // 2]
        params[i] = SamplingParams(max_tokens=params[i].max_tokens, ignore_eos=True, stop_token_ids=(stop,))
        expected[i] = alone[i][:alone[i].index(stop) + 1]
    # (decode steps of all 8 rows only: nothing checked here depends on the row buckets, and each would add three
    # steps to compile)
    crowded = build_engine(small, EngineConfig(max_slots=8, page_size=16, num_pages=14, max_pages_per_slot=5,
                                                chunk_buckets=(16, 64), prefill_rows=(1, 4), decode_page_buckets=(1, 2),
                                                decode_row_buckets=(8,)))
    shapes = []
    dispatch = crowded.runner.dispatch
    crowded.runner.dispatch = lambda inp: (shapes.append(inp.shape), dispatch(inp))[1]  # type: ignore[method-assign]
    together = crowded.generate(prompts, params)
    assert {s[2] for s in shapes if s[1] == 1} >= {2, 5}  # decode steps over narrow page tables too
    assert {s[0] for s in shapes if s[1] > 1} == {1, 4}  # prefill steps of one and of four prompts
    assert crowded.scheduler.num_preemptions > 0
    assert [r.output_ids for r in together] == expected
    assert [r.finish_reason for r in together] == [
        "stop" if p.stop_token_ids else "length" for p in params]
    assert all(ref == 0 for ref in crowded.scheduler.pages.refs)
    crowded.scheduler.pages.check()


def test_common_prefix_is_stored_once(small):
    engine = build_engine(small, EngineConfig(max_slots=2, page_size=16, num_pages=40, max_pages_per_slot=16,
                                               chunk_buckets=(64,)))
    prefix = random_prompts(1, 200, 200, seed=5)[0]
    first = engine.submit(prefix + [300, 301], SamplingParams(max_tokens=40, ignore_eos=True))
    while first.pending > 1 or not first.output_ids:
        engine.step()
    second = engine.submit(prefix + [400], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert second.cached_tokens == 192
    assert second.pages[:12] == first.pages[:12]
    in_use = sum(1 for ref in engine.scheduler.pages.refs if ref)
    assert in_use == len(first.pages) + len(second.pages) - 12
    engine.run_until_done()
    alone = build_engine(small, EngineConfig(max_slots=1, page_size=16, num_pages=16, max_pages_per_slot=16,
                                              chunk_buckets=(64,))).generate([prefix + [400]], [second.params])[0]
    assert second.output_ids == alone.output_ids


def test_long_prompt_never_stalls_decoding_streams(small):
    engine = build_engine(small, EngineConfig(max_slots=9, page_size=16, num_pages=200, max_pages_per_slot=130,
                                               chunk_buckets=(16, 256), decode_row_buckets=(9,)))
    streams = [engine.submit(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in random_prompts(8, 4, 12)]
    while any(not s.output_ids for s in streams):
        engine.step()
    long = engine.submit(random_prompts(1, 2000, 2000, seed=9)[0], SamplingParams(max_tokens=2))
    steps = 0
    while not long.output_ids:
        before = [len(s.output_ids) for s in streams]
        engine.step()
        steps += 1
        assert [len(s.output_ids) for s in streams] == [b + 1 for b in before], "a stream skipped a step"
    assert steps == 8 + 1  # 2000 tokens in chunks of 256, and the last chunk's token is read a step later


def test_no_compilation_after_warm_up(small):
    engine = build_engine(small, EngineConfig(max_slots=4, page_size=16, num_pages=64, max_pages_per_slot=16,
                                               chunk_buckets=(16, 64), decode_page_buckets=(4,)))
    engine.generate(random_prompts(2, 3, 5), [SamplingParams(max_tokens=2)] * 2)
    before = compilation_count()
    rng = random.Random(3)
    prompts = random_prompts(100, 1, 150, seed=3)
    params = [SamplingParams(max_tokens=rng.randint(1, 4), temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]),
                             top_p=rng.choice([1.0, 0.9]), seed=i) for i in range(100)]
    engine.generate(prompts, params)
    assert compilation_count() == before


def test_cancel_frees_slot_and_pages_within_a_step(smollm, embedded_engine):
    request = embedded_engine.submit([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        embedded_engine.step()
    slots = embedded_engine.scheduler.slots
    assert request.pages and slots.num_free == SERVING_ENGINE.max_slots - 1
    embedded_engine.cancel(request.request_id)
    embedded_engine.step()
    assert request.finish_reason == "abort"
    assert slots.num_free == SERVING_ENGINE.max_slots
    assert all(ref == 0 for ref in embedded_engine.scheduler.pages.refs)


def test_stop_strings_logprobs_and_stop_tokens(smollm, embedded_engine):
    tok = smollm.tokenizer
    prompt = tok.encode("The capital of France is")
    full = embedded_engine.generate([prompt], [SamplingParams(max_tokens=12, logprobs=5)])[0]
    assert full.text.startswith(" Paris.")
    assert len(full.logprobs) == len(full.output_ids)
    for token, (chosen, top) in zip(full.output_ids, full.logprobs):
        assert len(top) == 5 and top[0][0] == token and top[0][1] == pytest.approx(chosen)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    cut = embedded_engine.generate([prompt], [SamplingParams(max_tokens=12, stop=(".",))])[0]
    assert cut.text == " Paris" and cut.finish_reason == "stop"
    paris = full.output_ids[0]
    by_id = embedded_engine.generate([prompt], [SamplingParams(max_tokens=12, stop_token_ids=(paris,))])[0]
    assert by_id.output_ids == [paris] and by_id.finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_batch(small, alone_small):
    prompts = random_prompts(4, 5, 20, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    batched = build_engine(small, EngineConfig(max_slots=4, page_size=16, num_pages=16, max_pages_per_slot=4,
                                               chunk_buckets=(16, 64))).generate(prompts, [params] * 4)
    alone = alone_small.generate(prompts, [params] * 4)
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    assert len({tuple(r.output_ids) for r in batched}) > 1


def test_engine_thread_streams_updates_through_outboxes(smollm, embedded_engine):
    prompt = smollm.tokenizer.encode("The capital of France is")
    embedded_engine.start()
    try:
        requests = [embedded_engine.submit(prompt, SamplingParams(max_tokens=10)) for _ in range(2)]
        for request in requests:
            box = embedded_engine.outbox(request.request_id)
            ids, text, reason = [], "", None
            while reason is None:
                update = box.get(timeout=120)
                ids += update.token_ids
                text += update.text
                reason = update.finish_reason
            assert ids == request.output_ids and text == request.text and reason == request.finish_reason
            assert text.startswith(" Paris")
    finally:
        embedded_engine.stop()


def test_no_step_branches_on_a_device_value(small):
    """XLA's GPU conditional (and loop) blocks the host until the stream reaches it: a step has neither. Sampling,
    where the random draws may loop, runs after the step, only for steps where a row samples."""
    from jaxserve.runner import StepRunner

    runner = StepRunner(small, EngineConfig(max_slots=2, page_size=16, num_pages=8, max_pages_per_slot=4,
                                            chunk_buckets=(16,)))
    assert {rows for rows, _, _ in runner._samplers} == {1, 2}
    assert runner.state.cache.padding_page and runner.state.cache.num_pages == 9  # see the next test
    for compiled in runner._compiled.values():
        text = compiled.as_text()
        assert " conditional(" not in text and " while(" not in text


def test_kv_pages_sized_from_device_memory():
    """kv_memory_fraction: the pages that fit in that share of every device's limit beside what is in use, in
    multiples of the sequence axis, less the padding page; too few for one slot is an error naming the figures."""
    from jaxserve.runner import pages_in_memory

    gib = 2**30
    one = [{"bytes_limit": 80 * gib, "bytes_in_use": 16 * gib}]
    assert pages_in_memory(one, 0.9, gib // 4, 1, reserved=1, at_least=64) == (72 - 16) * 4 - 1
    two = one + [{"bytes_limit": 80 * gib, "bytes_in_use": 20 * gib}]  # the fullest device sets the pool
    assert pages_in_memory(two, 0.9, gib // 4, 2, reserved=0, at_least=64) == (72 - 20) * 4 * 2
    with pytest.raises(JaxserveError, match=r"leaves 0.00 GiB for KV pages beside the 16.00 GiB in use: 0 pages, "
                                            r"fewer than the 64 of one full slot"):
        pages_in_memory(one, 0.2, gib // 4, 1, reserved=1, at_least=64)


def test_float8_kv_cache_answers_paris(smollm):
    """float8_e4m3fn pages: one byte a value, and the embedded model's answer survives them. (What they cost in
    quality is measured by benchmarks/kv_fp8_cpu.py: perplexity +1.65 % on the held-out text.)"""
    cfg = EngineConfig(max_slots=1, page_size=16, num_pages=16, max_pages_per_slot=8, chunk_buckets=(16,),
                       kv_cache_dtype="float8_e4m3fn")
    engine = build_engine(smollm, cfg)
    assert all(x.dtype == jnp.float8_e4m3fn for x in engine.runner.state.cache.k + engine.runner.state.cache.v)
    prompt = smollm.tokenizer.encode("The capital of France is")
    out = engine.generate([prompt, prompt[:3]], [SamplingParams(max_tokens=4)] * 2)[0]
    assert out.text.startswith(" Paris")
    # The Mosaic GPU kernels read 8-bit pages in 128-byte rows; SmolLM2's heads are 64 wide.
    with pytest.raises(JaxserveError, match=r"kv_cache_dtype='float8_e4m3fn': attention='pallas' \(mosaic_gpu\) "
                                            r"cannot read 8-bit pages at this model's head_dim=64"):
        build_engine(smollm, dataclasses.replace(cfg, attention="pallas"))


def test_kv_memory_fraction_needs_a_device_that_reports_memory(small):
    from jaxserve.runner import StepRunner

    cfg = EngineConfig(max_slots=2, page_size=16, num_pages=8, max_pages_per_slot=4, chunk_buckets=(16,),
                       kv_memory_fraction=0.9)
    with pytest.raises(JaxserveError, match="kv_memory_fraction needs devices that report their memory; cpu device 0"):
        StepRunner(small, cfg)


def test_padding_tokens_write_only_the_padding_page(small):
    """The engine's cache has one page past its pool: padding tokens (valid False) write their K/V there and no
    page of the pool changes. Without that page (a pool split over devices) their writes are dropped."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.model.kv_cache import KVCache
    from jaxserve.model.transformer import forward as forward_

    forward = jax.jit(forward_, static_argnames=("cfg", "attention"))  # as the engine's step runs it
    tokens, positions = jnp.asarray([[5, 6, 7, 8]], jnp.int32), jnp.arange(4)[None]
    valid = jnp.asarray([[True, True, False, False]])  # pages of 2 tokens: page 0 valid, page 1 padding
    for padding_page in (True, False):
        cache = KVCache.zeros(small.config, 3, 2, jnp.float32, padding_page=padding_page)
        out = forward(small.weights, small.config, tokens, positions, valid, jnp.asarray([[0, 1]]), cache,
                      attention="reference")
        for pages in (*out.cache.k, *out.cache.v):
            pages = np.asarray(pages)
            assert pages.shape[1] == 3 + padding_page and out.cache.padding_page == padding_page
            assert np.abs(pages[:, 0]).any(), "the valid tokens' K/V is missing"
            assert not np.abs(pages[:, 1:3]).any(), "a padding token wrote into the pool"
            assert np.abs(pages[:, 3:]).any() == padding_page
    # One token (the in-place update of decode at batch 1) goes to the padding page too when it pads.
    cache = KVCache.zeros(small.config, 3, 2, jnp.float32, padding_page=True)
    for ok in (True, False):
        out = forward(small.weights, small.config, tokens[:, :1], positions[:, :1], jnp.asarray([[ok]]),
                      jnp.asarray([[1, 0]]), cache, attention="reference")
        k = np.asarray(out.cache.k[0])
        assert np.abs(k[:, 1]).any() == ok and np.abs(k[:, 3]).any() != ok and not np.abs(k[:, [0, 2]]).any()


def test_a_request_still_waiting_at_its_deadline_is_dropped_unscheduled(alone_small):
    import time

    engine = alone_small
    steps = engine.stats.steps
    late = engine.submit([5, 6, 7], SamplingParams(max_tokens=4), deadline=time.monotonic() - 1)
    on_time = engine.submit([5, 6, 7], SamplingParams(max_tokens=4), deadline=time.monotonic() + 600)
    engine.run_until_done()
    assert (late.finish_reason, late.output_ids, late.num_computed) == ("abort", [], 0)
    assert (on_time.finish_reason, len(on_time.output_ids)) == ("length", 4)
    assert engine.stats.steps - steps <= 5, "only the request on time was run"
    for r in (late, on_time):
        engine.close_outbox(r.request_id)
