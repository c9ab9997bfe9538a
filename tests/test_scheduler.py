"""Property tests of the host side: scheduler, page allocator and slots, with no device at all."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine.batch import StepInput
from jaxserve.engine.pages import PageAllocator, page_hashes
from jaxserve.engine.request import Request, State
from jaxserve.engine.scheduler import Chunk, Scheduler, StepPlan
from jaxserve.step import pack_step_input, unpack_step_input


def fake_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids)) % 97


def chunks(plan: StepPlan) -> list[Chunk]:
    return plan.prefill + plan.decode


def simulate(scheduler: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 20_000,
             stop_rng: random.Random | None = None, in_use: list[int] | None = None) -> int:
    """Runs the scheduler against a pretend device, one step ahead as the engine does: step N+1 is
    planned before step N is committed. Returns the steps taken; checks invariants every step. `in_use` gets the
    pages taken at each step."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    size = scheduler.cfg.page_size
    in_flight: list[tuple[Chunk, int | None]] = []
    truth: dict[str, list[int]] = {}  # what the device has: every token, sampled or read
    while pending or scheduler.has_work or in_flight:
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        plan = scheduler.schedule()
        if plan.prefill:
            assert len(plan.prefill) <= scheduler.cfg.max_prefill_rows(plan.prefill_width)
            assert all(c.length <= plan.prefill_width for c in plan.prefill)
            assert len({c.request.request_id for c in plan.prefill}) == len(plan.prefill)
        check_step_inputs(scheduler, plan)
        launched = []
        for chunk in chunks(plan):
            request = chunk.request
            assert request.state is State.RUNNING and request.slot is not None
            assert chunk.start + chunk.length == request.num_computed
            for pos in range(chunk.start, chunk.start + chunk.length):
                page = request.pages[pos // size]
                assert scheduler.pages.refs[page] == 1, f"write to shared page {page}"
            span = scheduler.attention_span or chunk.start + 1
            for pos in range(max(0, chunk.start - span + 1), chunk.start):  # what the chunk's queries read
                assert pos // size >= request.released and scheduler.pages.refs[request.pages[pos // size]] >= 1, \
                    f"position {pos} inside the window is on a released page"
            # the sampled token depends only on the tokens before it, as a model's would
            seen = truth.setdefault(request.request_id, list(request.all_ids))
            assert seen[:len(request.all_ids)] == request.all_ids
            token = None
            if chunk.sample:
                end = chunk.start + chunk.length
                token = fake_token(seen[:end])
                if stop_rng is not None and stop_rng.random() < 0.05:
                    token = 96  # a stop token
                truth[request.request_id] = seen[:end] + [token]
            launched.append((chunk, token))
        for chunk, token in in_flight:
            scheduler.commit(chunk, token)
        in_flight = launched
        scheduler.pages.check()
        if in_use is not None:
            in_use.append(sum(1 for ref in scheduler.pages.refs if ref))
        for request in scheduler.running:  # the kept prefix-hash chain is the one its tokens give, whatever happened
            assert request.page_hashes == page_hashes(request.all_ids, size, len(request.page_hashes))
        step += 1
        assert step < max_steps, "no progress"
    return step


def check_step_inputs(scheduler: Scheduler, plan: StepPlan) -> None:
    """The step inputs built from a plan hold each row's tokens, positions and pages; padding rows nothing."""
    cfg = scheduler.cfg
    for rows, width in ((plan.prefill, plan.prefill_width), (plan.decode, 1)):
        if not rows:
            continue
        inp = StepInput.build([None, *rows, None], width, cfg.max_pages_per_slot, cfg.max_slots)
        assert inp.slots[0] == inp.slots[-1] == cfg.max_slots and not inp.valid[[0, -1]].any()
        for i, chunk in enumerate(rows, start=1):
            r, end = chunk.request, chunk.start + chunk.length
            known = r.all_ids[chunk.start:end]
            assert list(inp.tokens[i, :len(known)]) == known and inp.feed[i] == (len(known) < chunk.length)
            assert list(inp.positions[i, :chunk.length]) == list(range(chunk.start, end))
            assert inp.valid[i].sum() == chunk.length == inp.last[i] + 1 and inp.slots[i] == r.slot
            assert list(inp.page_table[i, :len(r.pages)]) == r.pages
        # one device copy carries what the step reads; unpacked, it gives back the same arrays
        for name, x in unpack_step_input(pack_step_input(inp), width, cfg.max_pages_per_slot).items():
            assert np.array_equal(x, getattr(inp, name)) and x.dtype == getattr(inp, name).dtype, name


requests_strategy = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 70), st.integers(1, 20), st.integers(0, 3)),
    min_size=1, max_size=24)


@settings(max_examples=150, deadline=None)
@given(requests_strategy, st.integers(1, 6), st.sampled_from([4, 8, 16]), st.integers(0, 40),
       st.sampled_from([(1,), (1, 2, 4)]), st.sampled_from([None, None, 3, 21]), st.randoms())
def test_every_request_finishes_and_nothing_leaks(specs, max_slots, page_size, extra_pages, prefill_rows, span, rng):
    """With `span` (a model whose every layer has a sliding window) pages behind the window go back to the pool
    as sequences grow; simulate checks that no query reads one."""
    longest = max(n + m for _, n, m, _ in specs)
    pages_per_slot = -(-longest // page_size)
    cfg = EngineConfig(max_slots=max_slots, page_size=page_size, num_pages=pages_per_slot + extra_pages,
                       max_pages_per_slot=pages_per_slot, chunk_buckets=(8, 32), prefill_rows=prefill_rows)
    scheduler = Scheduler(cfg, attention_span=span)
    prefixes = [[rng.randrange(97) for _ in range(64)] for _ in range(4)]  # shared system prompts
    arrivals = []
    for i, (at, n, m, prefix) in enumerate(specs):
        prompt = (prefixes[prefix] + [rng.randrange(97) for _ in range(n)])[-n:] if prefix else [
            rng.randrange(97) for _ in range(n)]
        arrivals.append((at, Request(f"r{i}", prompt, SamplingParams(max_tokens=m), arrival=i,
                                     stop_ids=frozenset({96}))))
    simulate(scheduler, arrivals, stop_rng=rng)
    for _, r in arrivals:
        assert r.finished and r.unread == 0 and r.pages == [] and r.slot is None
        if r.finish_reason == "stop":
            assert r.output_ids[-1] == 96 and 96 not in r.output_ids[:-1]
        else:
            assert r.finish_reason == "length" and len(r.output_ids) == r.params.max_tokens and 96 not in r.output_ids
    assert all(ref == 0 for ref in scheduler.pages.refs)
    assert scheduler.slots.num_free == max_slots
    scheduler.pages.check()


def test_page_hashes_extend_a_known_chain_as_a_recomputation_would():
    ids = list(range(100, 171))  # 4 full pages of 16 and 7 tokens
    full = page_hashes(ids, 16, 4)
    assert len(set(full)) == 4 and page_hashes(ids, 16, 3) == full[:3]
    for k in range(5):
        assert page_hashes(ids, 16, 4, known=full[:k]) == full
    assert page_hashes(ids, 16, 2, known=full) == full[:2]  # fewer than known: the chain's first
    assert page_hashes(ids[:16] + [0] + ids[17:], 16, 4)[1:] != full[1:]  # a page's hash covers its whole prefix


def test_outputs_do_not_depend_on_pool_size():
    """Preemption and recomputation leave every request's tokens as if it had run alone."""
    rng = random.Random(0)
    specs = [([rng.randrange(97) for _ in range(rng.randint(1, 60))], rng.randint(1, 15)) for _ in range(20)]

    def run(num_pages: int, max_slots: int) -> tuple[list[list[int]], int]:
        cfg = EngineConfig(max_slots=max_slots, page_size=8, num_pages=num_pages, max_pages_per_slot=10,
                           chunk_buckets=(8, 32), prefill_rows=(1, 2, 4))
        scheduler = Scheduler(cfg)
        requests = [Request(f"r{i}", p, SamplingParams(max_tokens=m), arrival=i) for i, (p, m) in enumerate(specs)]
        simulate(scheduler, [(0, r) for r in requests])
        return [r.output_ids for r in requests], scheduler.num_preemptions

    alone, none = run(num_pages=10, max_slots=1)
    crowded, preemptions = run(num_pages=12, max_slots=8)
    assert none == 0 and preemptions > 0
    assert crowded == alone


def test_a_sliding_window_keeps_a_long_sequence_in_a_few_pages():
    """Every layer windowed (8 positions): a 200-token sequence (50 pages of 4) holds at most 5 pages at once (the
    window's, the chunk's and the one the committed length reaches into), with the tokens it has when it keeps them
    all."""
    def run(span: int | None) -> tuple[Request, list[int]]:
        cfg = EngineConfig(max_slots=1, page_size=4, num_pages=50, max_pages_per_slot=50, chunk_buckets=(8,))
        request = Request("r", list(range(1, 40)), SamplingParams(max_tokens=161), arrival=0)
        in_use: list[int] = []
        simulate(Scheduler(cfg, attention_span=span), [(0, request)], in_use=in_use)
        return request, in_use

    (windowed, few), (full, every) = run(8), run(None)
    assert windowed.output_ids == full.output_ids and len(windowed.output_ids) == 161
    assert max(few) <= 5 and max(every) == 50 and few[-1] == every[-1] == 0


def test_shared_prefix_pages_are_referenced_not_copied():
    cfg = EngineConfig(max_slots=2, page_size=16, num_pages=64, max_pages_per_slot=32, chunk_buckets=(64,))
    scheduler = Scheduler(cfg)
    prefix = list(range(200))
    a = Request("a", prefix + [1, 2, 3], SamplingParams(max_tokens=50), arrival=0)
    scheduler.add(a)
    while not a.output_ids:  # a's prompt is in the cache
        for chunk in chunks(scheduler.schedule()):
            scheduler.commit(chunk, 7 if chunk.sample else None)
    in_use_before = sum(1 for ref in scheduler.pages.refs if ref)
    b = Request("b", prefix + [9, 9], SamplingParams(max_tokens=5), arrival=1)
    scheduler.add(b)
    scheduler.schedule()
    assert b.cached_tokens == 192  # 12 full pages of the 200-token prefix
    assert b.pages[:12] == a.pages[:12]
    assert all(scheduler.pages.refs[p] == 2 for p in b.pages[:12])
    assert sum(1 for ref in scheduler.pages.refs if ref) == in_use_before + len(b.pages) - 12


def test_finished_prefix_stays_cached_until_evicted():
    allocator = PageAllocator(num_pages=2, page_size=4)
    p = allocator.allocate()
    assert p is not None
    allocator.register(p, 123)
    allocator.release(p)
    assert allocator.num_available == 2
    assert allocator.lookup(123) == p  # still cached
    allocator.release(p)
    q1, q2 = allocator.allocate(), allocator.allocate()  # the second evicts the cached page
    assert {q1, q2} == {0, 1} and allocator.lookup(123) is None
    allocator.check()


def test_lower_priority_value_is_admitted_first_and_ties_keep_arrival_order():
    scheduler = Scheduler(EngineConfig(max_slots=1, page_size=4, num_pages=8, max_pages_per_slot=4, chunk_buckets=(4,)))
    params = SamplingParams(max_tokens=2)
    order = [("late", 5), ("first", 0), ("second", 0), ("urgent", -1)]
    for arrival, (name, priority) in enumerate(order):
        scheduler.add(Request(name, [1, 2, 3], params, arrival, priority=priority))
    admitted = []
    while scheduler.has_work:
        for chunk in chunks(scheduler.schedule()):
            if chunk.request.request_id not in admitted:
                admitted.append(chunk.request.request_id)
            scheduler.commit(chunk, 7 if chunk.sample else None)
    assert admitted == ["urgent", "first", "second", "late"]


def test_prefill_budget_is_independent_of_the_compiled_widths():
    """With only 32-token chunks compiled and a budget of 256 tokens, one step prefills 8 prompts."""
    cfg = EngineConfig(max_slots=16, page_size=16, num_pages=64, max_pages_per_slot=4, chunk_buckets=(32,),
                       prefill_rows=(1, 2, 8), prefill_tokens=256)
    assert cfg.prefill_buckets == ((1, 32), (2, 32), (8, 32))
    assert EngineConfig(chunk_buckets=(32,), prefill_rows=(1, 2, 8)).prefill_buckets == ((1, 32),)
    scheduler = Scheduler(cfg)
    for i in range(12):
        scheduler.add(Request(f"r{i}", list(range(i, i + 30)), SamplingParams(max_tokens=4), arrival=i))
    plan = scheduler.schedule()
    assert [c.request.request_id for c in plan.prefill] == [f"r{i}" for i in range(8)]
    assert plan.prefill_width == 32


def test_negative_prefill_budget_is_rejected():
    import pytest

    from jaxserve.errors import JaxserveError

    with pytest.raises(JaxserveError, match="prefill_tokens must be >= 0"):
        EngineConfig(prefill_tokens=-1)


def test_decode_row_buckets_choose_the_compiled_decode_rows():
    import pytest

    from jaxserve.errors import JaxserveError

    assert EngineConfig(max_slots=200).decode_buckets == (1, 4, 16, 64, 200)
    cfg = EngineConfig(max_slots=200, num_pages=12800, decode_row_buckets=(1, 64))
    assert cfg.decode_buckets == (1, 64, 200)
    assert [cfg.decode_rows_for(n) for n in (1, 2, 64, 65)] == [1, 64, 64, 200]
    with pytest.raises(JaxserveError, match=r"decode_row_buckets=\(0, 4\) must lie in \[1, max_slots=8\]"):
        EngineConfig(decode_row_buckets=(0, 4))


def test_chunks_for_a_prompt_longer_than_every_chunk_lists_each_width_once():
    from jaxserve.config import chunks_for

    assert chunks_for((512,), 1000) == (512,)
    assert chunks_for((16, 64, 256), 100) == (16, 64, 256)
    assert chunks_for((16, 64, 256), 10) == (16,)


def test_bench_compiles_page_widths_at_most_a_quarter_apart_and_two_row_counts():
    from jaxserve.bench import bench_config

    cfg = bench_config(32, 32, 128)  # 10 pages a slot; a prompt and its first token fill 3
    assert cfg.decode_page_widths == (3, 4, 5, 7, 9, 10)
    assert cfg.decode_buckets == (16, 32)
    assert [cfg.decode_rows_for(n) for n in (8, 16, 17)] == [16, 16, 32]
    one = bench_config(1, 2000, 1)
    assert one.decode_page_widths == (126,) and one.decode_buckets == (1,)


def test_preempted_requests_wait_for_room_instead_of_thrashing():
    """The offline load in small: every request submitted at once, more than the pool holds at full length.
    When the pages run out the latest arrivals are preempted once each and come back only when their whole
    sequence fits beside a page of growth for every running request; a preempted request re-admitted as soon
    as its first chunk fit would be preempted again a few steps later, over and over."""
    cfg = EngineConfig(max_slots=32, page_size=8, num_pages=20 * 16, max_pages_per_slot=16, chunk_buckets=(8, 32),
                       prefill_rows=(1, 2, 4))
    scheduler = Scheduler(cfg)
    rng = random.Random(1)
    requests = [Request(f"r{i}", [rng.randrange(97) for _ in range(64)], SamplingParams(max_tokens=64), arrival=i)
                for i in range(32)]
    simulate(scheduler, [(0, r) for r in requests])
    assert all(r.finished and len(r.output_ids) == 64 for r in requests)
    assert 0 < scheduler.num_preemptions <= 32 - 20, scheduler.num_preemptions  # 30 when re-admitted on a chunk


def test_every_packed_field_of_a_one_row_step_starts_256_byte_aligned():
    # A one-row step's fields are contiguous slices of the packed input, which XLA passes to the Mosaic GPU
    # kernels as pointers into it; those refuse an operand that is not 256-byte aligned.
    from jaxserve.step import _packed_columns

    for width, pages in ((1, 7), (1, 512), (512, 128), (3, 1)):
        packed = pack_step_input(StepInput.build([None], width, pages, 4))
        starts = [where.start * packed.itemsize for where in _packed_columns(width, pages).values()]
        assert all(start % 256 == 0 for start in starts), (width, pages, starts)
        assert packed.shape[1] == _packed_columns(width, pages)["prompt_len"].stop


def test_the_engine_package_imports_no_jax():
    import pkgutil
    import subprocess
    import sys

    import jaxserve.engine

    modules = [f"jaxserve.engine.{m.name}" for m in pkgutil.iter_modules(jaxserve.engine.__path__)]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert len(modules) >= 6 and out.strip() == "[]", out
