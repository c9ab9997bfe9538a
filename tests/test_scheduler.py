"""Property tests of the host side: scheduler, page allocator and slots, with no device at all."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import Request, State
from jaxserve.engine.scheduler import Scheduler


def fake_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids)) % 97


def simulate(scheduler: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 20_000) -> int:
    """Runs the scheduler against a pretend device; returns the steps taken. Checks invariants every step."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    size = scheduler.cfg.page_size
    while pending or scheduler.has_work:
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        plan = scheduler.schedule()
        work = ([(plan.prefill.request, plan.prefill.start, plan.prefill.length)] if plan.prefill else []) + [
            (r, r.num_computed, 1) for r in plan.decode]
        for request, start, length in work:
            assert request.state is State.RUNNING and request.slot is not None
            assert start == request.num_computed
            for pos in range(start, start + length):
                page = request.pages[pos // size]
                assert scheduler.pages.refs[page] == 1, f"write to shared page {page}"
        for request, start, length in work:
            done = start + length == request.num_tokens
            scheduler.commit(request, length, fake_token(request.all_ids) if done else None)
        scheduler.pages.check()
        step += 1
        assert step < max_steps, "no progress"
    return step


requests_strategy = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 70), st.integers(1, 20), st.integers(0, 3)),
    min_size=1, max_size=24)


@settings(max_examples=150, deadline=None)
@given(requests_strategy, st.integers(1, 6), st.sampled_from([4, 8, 16]), st.integers(0, 40), st.randoms())
def test_every_request_finishes_and_nothing_leaks(specs, max_slots, page_size, extra_pages, rng):
    longest = max(n + m for _, n, m, _ in specs)
    pages_per_slot = -(-longest // page_size)
    cfg = EngineConfig(max_slots=max_slots, page_size=page_size, num_pages=pages_per_slot + extra_pages,
                       max_pages_per_slot=pages_per_slot, chunk_buckets=(8, 32))
    scheduler = Scheduler(cfg)
    prefixes = [[rng.randrange(97) for _ in range(64)] for _ in range(4)]  # shared system prompts
    arrivals = []
    for i, (at, n, m, prefix) in enumerate(specs):
        prompt = (prefixes[prefix] + [rng.randrange(97) for _ in range(n)])[-n:] if prefix else [
            rng.randrange(97) for _ in range(n)]
        arrivals.append((at, Request(f"r{i}", prompt, SamplingParams(max_tokens=m), arrival=i)))
    simulate(scheduler, arrivals)
    for _, r in arrivals:
        assert r.finished and r.finish_reason == "length" and len(r.output_ids) == r.params.max_tokens
        assert r.pages == [] and r.slot is None
    assert all(ref == 0 for ref in scheduler.pages.refs)
    assert scheduler.slots.num_free == max_slots
    scheduler.pages.check()


def test_outputs_do_not_depend_on_pool_size():
    """Preemption and recomputation leave every request's tokens as if it had run alone."""
    rng = random.Random(0)
    specs = [([rng.randrange(97) for _ in range(rng.randint(1, 60))], rng.randint(1, 15)) for _ in range(20)]

    def run(num_pages: int, max_slots: int) -> tuple[list[list[int]], int]:
        cfg = EngineConfig(max_slots=max_slots, page_size=8, num_pages=num_pages, max_pages_per_slot=10,
                           chunk_buckets=(8, 32))
        scheduler = Scheduler(cfg)
        requests = [Request(f"r{i}", p, SamplingParams(max_tokens=m), arrival=i) for i, (p, m) in enumerate(specs)]
        simulate(scheduler, [(0, r) for r in requests])
        return [r.output_ids for r in requests], scheduler.num_preemptions

    alone, none = run(num_pages=10, max_slots=1)
    crowded, preemptions = run(num_pages=12, max_slots=8)
    assert none == 0 and preemptions > 0
    assert crowded == alone


def test_shared_prefix_pages_are_referenced_not_copied():
    cfg = EngineConfig(max_slots=2, page_size=16, num_pages=64, max_pages_per_slot=32, chunk_buckets=(64,))
    scheduler = Scheduler(cfg)
    prefix = list(range(200))
    a = Request("a", prefix + [1, 2, 3], SamplingParams(max_tokens=50), arrival=0)
    scheduler.add(a)
    while a.pending > 1 or not a.output_ids:  # a's prompt is in the cache
        plan = scheduler.schedule()
        for r, s, n in ([(plan.prefill.request, plan.prefill.start, plan.prefill.length)] if plan.prefill else []) + [
                (r, r.num_computed, 1) for r in plan.decode]:
            scheduler.commit(r, n, 7 if s + n == r.num_tokens else None)
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
        plan = scheduler.schedule()
        for request in [plan.prefill.request] if plan.prefill else plan.decode:
            if request.request_id not in admitted:
                admitted.append(request.request_id)
            done = request.num_computed + request.pending == request.num_tokens
            scheduler.commit(request, request.pending, 7 if done else None)
    assert admitted == ["urgent", "first", "second", "late"]
