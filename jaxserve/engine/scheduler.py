"""The scheduler: decides each step's work and changes only host state. No jax here.

Every step runs the decode rows (requests with exactly one token to compute) and at most one
prefill chunk (the oldest request with more than one), so a long prompt delays running streams
by one chunk at most. Pages are taken as tokens need them; when none is left, the most recent
arrival is preempted (its pages freed, recomputed later, its prefix likely still cached).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from jaxserve.config import EngineConfig
from jaxserve.engine.pages import PageAllocator, page_hashes
from jaxserve.engine.request import Request, State
from jaxserve.engine.slots import SlotTable
from jaxserve.errors import InputError


@dataclass
class Chunk:
    request: Request
    start: int  # first position computed
    length: int  # tokens computed this step


@dataclass
class StepPlan:
    prefill: Chunk | None = None
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.decode


@dataclass
class Committed:
    """What a step changed for one request: the tokens it appended, and whether it finished."""

    request: Request
    new_ids: list[int]


class Scheduler:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.pages = PageAllocator(cfg.num_pages, cfg.page_size)
        self.slots = SlotTable(cfg.max_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Rejects, up front, a request that could never fit in one slot."""
        need = request.max_total_tokens
        if need > self.cfg.max_seq_len:
            raise InputError(
                f"prompt of {len(request.prompt_ids)} tokens plus max_tokens={request.params.max_tokens} needs "
                f"{need} tokens, more than a slot holds ({self.cfg.max_seq_len}); shorten the prompt or lower max_tokens"
            )

    def add(self, request: Request) -> None:
        """Queues a request behind every waiting one of the same or a lower (more urgent) priority."""
        self.check_fits(request)
        index = next((i for i, r in enumerate(self.waiting) if r.priority > request.priority), len(self.waiting))
        self.waiting.insert(index, request)

    def abort(self, request: Request) -> None:
        """Removes a request wherever it is, freeing its slot and pages."""
        if request.state is State.WAITING and request in self.waiting:
            self.waiting.remove(request)
        elif request.state is State.RUNNING:
            self._release(request)
            self.running.remove(request)
        request.state = State.FINISHED
        request.finish_reason = request.finish_reason or "abort"

    def _admit(self) -> None:
        while self.waiting and self.slots.num_free:
            request = self.waiting[0]
            reusable = (request.num_tokens - 1) // self.cfg.page_size  # the last token's page stays private
            hashes = page_hashes(request.all_ids, self.cfg.page_size, reusable)
            needed_now = -(-min(request.pending, self.cfg.max_chunk) // self.cfg.page_size)
            if self.pages.num_available < needed_now and self.running:
                return  # wait for pages rather than thrash; with nothing running, admit and let it page in
            self.waiting.popleft()
            for h in hashes:
                page = self.pages.lookup(h)
                if page is None:
                    break
                request.pages.append(page)
            request.num_computed = len(request.pages) * self.cfg.page_size
            request.cached_tokens = min(request.num_computed, len(request.prompt_ids))
            slot = self.slots.acquire()
            assert slot is not None
            request.slot = slot
            request.state = State.RUNNING
            request.scheduled_at = request.scheduled_at or time.perf_counter()
            self.running.append(request)

    # -- planning ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's work. Allocates the pages it will write; may preempt."""
        self._admit()
        plan = StepPlan()
        for request in sorted(self.running, key=lambda r: r.arrival):
            if (request.state is State.RUNNING and request.pending == 1
                    and self._reserve(request, request.num_computed + 1, plan)):
                plan.decode.append(request)
        prefilling = [r for r in self.running if r.pending > 1]
        if prefilling:
            request = min(prefilling, key=lambda r: r.arrival)
            length = min(request.pending, self.cfg.max_chunk)
            if self._reserve(request, request.num_computed + length, plan):
                plan.prefill = Chunk(request, request.num_computed, length)
        return plan

    def _reserve(self, request: Request, upto: int, plan: StepPlan) -> bool:
        """Gives `request` pages for positions < upto, preempting later arrivals; False if it was preempted."""
        while len(request.pages) * self.cfg.page_size < upto:
            page = self.pages.allocate()
            if page is not None:
                request.pages.append(page)
                continue
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self._release(request)
        self.running.remove(request)
        request.state = State.WAITING
        request.num_computed = 0
        request.preemptions += 1
        self.num_preemptions += 1
        index = next((i for i, r in enumerate(self.waiting) if (r.priority, r.arrival) > (request.priority, request.arrival)),
                     len(self.waiting))
        self.waiting.insert(index, request)
        plan.preempted.append(request)
        if request in plan.decode:
            plan.decode.remove(request)

    def _release(self, request: Request) -> None:
        for page in request.pages:
            self.pages.release(page)
        request.pages = []
        if request.slot is not None:
            self.slots.release(request.slot)
            request.slot = None

    # -- after the step ----------------------------------------------------------------------
    def commit(self, request: Request, computed: int, token: int | None) -> None:
        """Records that `computed` more tokens are in the cache and, if sampled, the next token."""
        before = request.num_computed
        request.num_computed += computed
        size = self.cfg.page_size
        full_before, full_after = before // size, request.num_computed // size
        if full_after > full_before:
            hashes = page_hashes(request.all_ids, size, full_after)
            for i in range(full_before, full_after):
                self.pages.register(request.pages[i], hashes[i])
        if token is None:
            return
        request.output_ids.append(token)
        if token in request.stop_ids:
            self.finish(request, "stop")
        elif len(request.output_ids) >= request.params.max_tokens:
            self.finish(request, "length")

    def finish(self, request: Request, reason: str) -> None:
        if request.state is State.RUNNING:
            self._release(request)
            self.running.remove(request)
        request.state = State.FINISHED
        request.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
