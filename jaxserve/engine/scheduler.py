"""The scheduler: decides each step's work and changes only host state. No jax here.

Every step runs the decode rows (requests with exactly one token to compute) and one prefill
step of at most one largest chunk's worth of tokens (the oldest prompt's next chunk, plus chunks of
younger prompts in the remaining rows), so a long prompt delays running streams by one chunk at
most. Pages are taken as tokens need them; when none is left, the most recent arrival is
preempted (its pages freed, recomputed later, its prefix likely still cached).

`schedule` plans a step as if it had already run (positions computed, tokens sampled but
unread); `commit` later records what the step produced. Between the two the engine plans and
dispatches the next step, so the device never waits for the host to read a step's tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
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
    sample: bool = False  # the chunk ends at the request's last token: the step samples the next one
    drafts: list[int] = field(default_factory=list)  # speculative tokens after the last one: a verify row


@dataclass
class StepPlan:
    prefill: list[Chunk] = field(default_factory=list)  # one row each, all of width `prefill_width`
    prefill_width: int = 0
    decode: list[Chunk] = field(default_factory=list)
    verify: list[Chunk] = field(default_factory=list)  # speculative rows: the last token and its drafts
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode and not self.verify


class Scheduler:
    def __init__(self, cfg: EngineConfig, attention_span: int | None = None) -> None:
        """`attention_span`: how far back the model (and a draft model) reads, when every layer has a sliding
        window (ModelConfig.attention_span); the pages behind it are released as sequences grow."""
        self.cfg = cfg
        self.attention_span = attention_span
        self.pages = PageAllocator(cfg.num_pages, cfg.page_size, shards=cfg.parallel.sp)
        self.slots = SlotTable(cfg.max_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Speculative decoding (set by the engine): up to k drafts after each (request, k)'s tokens, all at once
        self.propose: Callable[[list[tuple[Request, int]]], list[list[int]]] | None = None

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
        request.unread = 0
        request.finish_reason = request.finish_reason or "abort"

    def _admit(self) -> None:
        deferred: list[Request] = []
        try:
            self._admit_in_order(deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _admit_in_order(self, deferred: list[Request]) -> None:
        """Admits waiting requests in order while slots and pages last. One whose next uncached prefix page a
        running request is computing now (the same prompt, or n > 1's siblings) waits for that prefill and then
        shares its pages instead of computing them again; it goes to `deferred`, keeping its place."""
        while self.waiting and self.slots.num_free:
            request = self.waiting[0]
            assert not request.unread, "a preempted request's last token is read before it is admitted again"
            reusable = (request.num_tokens - 1) // self.cfg.page_size  # the last token's page stays private
            hashes: list[int] = []
            if not request.params.reads_every_prompt_token:  # (those take no cached pages: see SamplingParams)
                hashes = self._hashes(request, reusable)[:reusable]  # kept: hashed once, however long it waits
                if self._computed_elsewhere(hashes):
                    deferred.append(self.waiting.popleft())
                    continue
            # A new request starts once its first chunk's pages are free. One that was preempted waits until its
            # whole sequence fits beside a page of growth for every running request: back on its first chunk's
            # pages alone it would be the first preempted again (the latest arrival), over and over. With
            # nothing running, either pages in.
            if request.preemptions:
                needed = -(-request.num_tokens // self.cfg.page_size) - self.pages.cached_prefix(hashes)
                needed += len(self.running)
            else:
                needed = -(-min(request.pending, self.cfg.max_chunk) // self.cfg.page_size)
            if self.running and self.pages.num_available < needed:
                return
            self.waiting.popleft()
            for h in hashes:
                page = self.pages.lookup(h)
                if page is None:
                    break
                request.pages.append(page)
            request.num_computed = request.num_committed = len(request.pages) * self.cfg.page_size
            request.cached_tokens = min(request.num_computed, len(request.prompt_ids))
            slot = self.slots.acquire()
            assert slot is not None
            request.slot = slot
            request.state = State.RUNNING
            request.scheduled_at = request.scheduled_at or time.perf_counter()
            self.running.append(request)

    def _computed_elsewhere(self, hashes: list[int]) -> bool:
        """Whether the first of these prefix hashes with no cached page is a prompt page of a running request that
        is still computing it."""
        cached = self.pages.cached_prefix(hashes)
        if cached == len(hashes):
            return False
        size = self.cfg.page_size
        for other in self.running:
            full = len(other.prompt_ids) // size
            if full > cached and other.num_committed < (cached + 1) * size and \
                    self._hashes(other, full)[cached] == hashes[cached]:
                return True
        return False

    def _hashes(self, request: Request, count: int) -> list[int]:
        """The request's kept prefix-hash chain, extended to at least `count` full pages (only pages not hashed
        before are hashed); not a copy."""
        if len(request.page_hashes) < count:
            request.page_hashes = page_hashes(request.all_ids, self.cfg.page_size, count, request.page_hashes)
        return request.page_hashes

    # -- planning ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's work. Allocates the pages it will write; may preempt."""
        self._admit()
        plan = StepPlan()
        decoding: list[Request] = []
        speculating: list[tuple[Request, int]] = []
        if self.attention_span is not None:
            for request in self.running:
                self._release_behind_window(request)
        for request in sorted(self.running, key=lambda r: r.arrival):
            if not (request.state is State.RUNNING and request.pending == 1
                    and len(request.output_ids) + request.unread < request.params.max_tokens):
                continue
            room = 0
            if self.speculates(request):
                if request.unread:  # its last token is still on the device: it waits a step for it
                    continue
                room = self._draft_room(request)
            if self._reserve(request, request.num_computed + 1 + room, plan):
                (speculating.append((request, room)) if room else decoding.append(request))
        verifying: list[tuple[Request, list[int]]] = []
        speculating = [(r, k) for r, k in speculating if r.state is State.RUNNING]
        if speculating:
            assert self.propose is not None
            for (request, k), drafts in zip(speculating, self.propose(speculating), strict=True):
                (verifying.append((request, drafts[:k])) if drafts else decoding.append(request))
        self._plan_prefill(plan)
        plan.decode = [self._advance(r, 1) for r in decoding if r.state is State.RUNNING]
        plan.verify = [self._advance(r, 1 + len(d), d) for r, d in verifying if r.state is State.RUNNING]
        return plan

    def speculates(self, request: Request) -> bool:
        """Whether a decoding request's next step proposes drafts: the engine speculates, the request did not turn
        it off, and nothing makes the step's positions differ in what they sample (penalties count the drafts as
        output; min_tokens holds stop tokens back by position)."""
        p = request.params
        return (self.propose is not None and p.speculate is not False and not p.penalized
                and len(request.output_ids) >= p.min_tokens and request.matcher is None)

    def _draft_room(self, request: Request) -> int:
        """How many drafts fit: `num_tokens`, within max_tokens (a verify emits drafts + 1) and the slot."""
        assert self.cfg.speculative is not None
        return max(0, min(self.cfg.speculative.num_tokens, request.params.max_tokens - len(request.output_ids) - 1,
                          self.cfg.max_seq_len - request.num_tokens))

    def _plan_prefill(self, plan: StepPlan) -> None:
        """The oldest prompt's next chunk sets the width; younger prompts fill the step's other rows."""
        prefilling = sorted((r for r in self.running if r.pending > 1), key=lambda r: r.arrival)
        if not prefilling:
            return
        width = self.cfg.width_for(min(prefilling[0].pending, self.cfg.max_chunk))
        for request in prefilling:
            if len(plan.prefill) == self.cfg.max_prefill_rows(width):
                break
            if request.state is not State.RUNNING:  # preempted to make room for an older one
                continue
            length = min(request.pending, width)
            if self._reserve(request, request.num_computed + length, plan):
                plan.prefill.append(self._advance(request, length))
        plan.prefill = [c for c in plan.prefill if c.request.state is State.RUNNING]
        plan.prefill_width = width

    def _advance(self, request: Request, length: int, drafts: list[int] | None = None) -> Chunk:
        """Counts `length` positions as computed, and their sample as drawn, before the step runs. A verify chunk's
        positions past the last token hold its drafts; what it keeps is known when it is read (commit_verify)."""
        chunk = Chunk(request, request.num_computed, length,
                      request.num_computed + length == request.num_tokens + len(drafts or ()), drafts or [])
        request.num_computed += length
        request.unread += chunk.sample
        return chunk

    def _reserve(self, request: Request, upto: int, plan: StepPlan) -> bool:
        """Gives `request` pages for positions < upto, preempting later arrivals; False if it was preempted."""
        while len(request.pages) * self.cfg.page_size < upto:
            page = self.pages.allocate(len(request.pages))
            if page is not None:
                request.pages.append(page)
                continue
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _release_behind_window(self, request: Request) -> None:
        """Returns the committed pages wholly behind the window of the request's next query (position num_computed,
        which reads from num_computed - span + 1 on) to the pool. A step still running reads from earlier
        positions, but the device runs steps in order: a page handed on is written only after it."""
        assert self.attention_span is not None
        behind = max(0, min(request.num_committed, request.num_computed - self.attention_span + 1)) // self.cfg.page_size
        for page in request.pages[request.released:behind]:
            self.pages.release(page)
        request.released = max(request.released, behind)

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
        request.num_committed = 0
        plan.preempted.append(request)

    def _release(self, request: Request) -> None:
        for page in request.pages[request.released:]:
            self.pages.release(page)
        request.pages = []
        request.released = 0
        if request.slot is not None:
            self.slots.release(request.slot)
            request.slot = None

    # -- after the step ----------------------------------------------------------------------
    def commit(self, chunk: Chunk, token: int | None) -> None:
        """Records what a dispatched chunk produced: its K/V (now shareable) and the sampled token.

        A request preempted since the chunk was planned keeps only the token: its pages are gone
        and it recomputes them, token included, when it runs again.
        """
        request = chunk.request
        if request.finished:
            return
        if request.state is State.RUNNING and chunk.start == request.num_committed:
            size = self.cfg.page_size
            full_before = request.num_committed // size
            request.num_committed += chunk.length
            full_after = request.num_committed // size
            if full_after > full_before:
                hashes = self._hashes(request, full_after)
                for i in range(full_before, full_after):
                    self.pages.register(request.pages[i], hashes[i])
        if not chunk.sample or token is None:
            return
        request.unread -= 1
        request.output_ids.append(token)
        if token in request.stop_ids:
            self.finish(request, "stop")
        elif len(request.output_ids) >= request.params.max_tokens:
            self.finish(request, "length")

    def commit_verify(self, chunk: Chunk, tokens: list[int]) -> list[int]:
        """Records a verify chunk's emitted tokens (its accepted drafts, then the target's own token) and returns
        those kept: up to a stop token or max_tokens. Rolls back by length: the K/V of the last token and the
        kept drafts stays, the pages past the new length go back to the pool."""
        request = chunk.request
        if request.finished:
            return []
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            if token in request.stop_ids or len(request.output_ids) + len(kept) >= request.params.max_tokens:
                break
        request.unread = 0
        request.output_ids.extend(kept)  # (first: the pages the commit registers are hashed from the tokens)
        if request.state is State.RUNNING and chunk.start == request.num_committed:
            request.num_computed = chunk.start + len(kept)  # the last token's position and the kept drafts'
            self.commit(Chunk(request, chunk.start, len(kept)), None)
            need = -(-request.num_tokens // self.cfg.page_size)
            for page in request.pages[need:]:
                self.pages.release(page)
            del request.pages[need:]
        if kept and kept[-1] in request.stop_ids:
            self.finish(request, "stop")
        elif len(request.output_ids) >= request.params.max_tokens:
            self.finish(request, "length")
        return kept

    def finish(self, request: Request, reason: str) -> None:
        if request.state is State.RUNNING:
            self._release(request)
            self.running.remove(request)
        elif request.state is State.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.unread = 0
        request.state = State.FINISHED
        request.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
