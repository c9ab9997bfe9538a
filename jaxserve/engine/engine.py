"""The engine loop: schedule, run, postprocess, hand back finished work.

Concurrency model. One engine thread owns every piece of mutable state: the scheduler (slots,
pages, queues) and the device runner. Other threads talk to it only through queues: `submit`
and `cancel` put messages in the inbox, and each request's updates come back on its own outbox
queue. The engine drains the inbox at the top of every step, so a cancelled request frees its
slot and pages within one step. Without a thread (`run_until_done`), the caller's thread is the
engine thread. Host code only; the device side is behind the `runner` (see jaxserve/step.py).

Faults. If a step raises, the loop records the exception in `fault`, calls the `on_fault`
listeners, fails every request in flight (a last Update with finish_reason "error") and stops: the
device state can no longer be trusted. A request whose sampled token has a non-finite log-probability
(its logits overflowed or turned NaN) ends alone with "error"; the others continue.

Constrained rows (SamplingParams.grammar). A row's mask of allowed tokens follows from every token before it, and
step N+1 is dispatched before step N is read. So a step with constrained rows is dispatched in two parts: its
forward now, its sampler once the masks are known. The engine reads step N and feeds each matcher its token; then,
while the device runs step N+1's forward, llguidance computes step N+1's masks on its own threads
(jaxserve.engine.grammar) and the engine thread plans and builds step N+2; it then enqueues step N+1's masked sampler
and step N+2 right behind it. Every row still decodes every step; steps without a constrained row are dispatched
whole, as before.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine.batch import MAX_SUPPRESSED, NUM_TOP, StepInput, StepOutput
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.grammar import Grammars
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Chunk, Scheduler, StepPlan
from jaxserve.engine.speculative import NgramProposer, SpecStats
from jaxserve.errors import InputError

if TYPE_CHECKING:  # the engine imports no jax; jaxserve.checkpoint does
    from jaxserve.checkpoint.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Dispatched = list[tuple[list[Chunk | None], Callable[[], StepOutput]]]  # rows of a dispatch, its lazy result


class Runner(Protocol):
    def dispatch_constrained(self, inp: StepInput) -> Callable[[np.ndarray], Callable[[], StepOutput]]: ...

    def dispatch(self, inp: StepInput, verify: bool = False) -> Callable[[], StepOutput]: ...


@dataclass
class Update:
    """New output of one request: tokens, their text, and the finish reason once it is done."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # set with finish_reason "error": what went wrong
    # with SamplingParams.prompt_logprobs, on the update of the first token: every prompt position's entry (None
    # at the first)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    max_decode_rows: int = 0
    device_wait_s: float = 0.0  # time the engine thread spent blocked on a step's result (the rest is host work)
    # the host work, by part: planning steps; building their inputs and enqueueing them on the device (dispatch);
    # committing their results
    schedule_s: float = 0.0
    dispatch_s: float = 0.0
    commit_s: float = 0.0
    # computing constrained rows' masks of allowed tokens (off the engine thread), and the steps that had some
    mask_s: float = 0.0
    masked_steps: int = 0


class _Unmasked:
    """A dispatched step whose constrained rows' sampler waits for their masks (see the module docstring):
    `sample(masks)` enqueues it and gives the step's result; `masks` is their computation once it has started."""

    def __init__(self, sample: Callable[[np.ndarray], Callable[[], StepOutput]]) -> None:
        self.sample = sample
        self.masks: Future[np.ndarray] | None = None

    def __call__(self) -> StepOutput:
        raise AssertionError("a constrained step was read before its masks were given")


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, cfg: EngineConfig, *, vocab_size: int,
                 context_len: int, draft: Runner | None = None, attention_span: int | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.scheduler = Scheduler(cfg, attention_span)
        self.stats = EngineStats()
        self.grammars = Grammars(tokenizer, vocab_size)
        self.spec = SpecStats()
        self.draft = draft
        if cfg.speculative is not None and cfg.speculative.method == "ngram":
            proposer = NgramProposer(cfg.speculative)
            self.scheduler.propose = lambda items: [proposer.propose(r.all_ids, k) for r, k in items]
        elif cfg.speculative is not None:
            if draft is None:
                raise ValueError("speculative method 'draft' needs the draft model's runner")
            self.scheduler.propose = self._draft_proposals
        self._arrivals = itertools.count()
        self._inbox: queue.Queue[tuple[str, Request]] = queue.Queue()
        self._outboxes: dict[str, queue.SimpleQueue[Update]] = {}
        self._sinks: dict[str, Callable[[Update], None]] = {}  # where each request's updates go
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._requests: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._in_flight: Dispatched | None = None
        self._mask_thread: ThreadPoolExecutor | None = None  # started at the first constrained step
        self._stopping = threading.Event()
        self.fault: BaseException | None = None  # the exception that stopped the loop
        self.on_fault: list[Callable[[BaseException], None]] = []  # called on the engine thread after a fault

    # -- the public surface ------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None, *,
               priority: int = 0, on_update: Callable[[Update], None] | None = None,
               deadline: float | None = None, matcher: Any = None) -> Request:
        """Validates and enqueues a request; its updates arrive on `outbox(request.request_id)`, or, with
        `on_update`, are passed to it on the engine thread (it must not block: an asyncio server hands them to
        its loop).

        Lower `priority` values are admitted first; equal ones in order of arrival. A request still waiting at its
        `deadline` (time.monotonic()) is dropped unscheduled, as if cancelled. After a fault the engine takes nothing
        more: submit raises RuntimeError. A request with SamplingParams.grammar gets a fresh matcher of it unless
        `matcher` is one (a server makes it off its event loop: `grammars.matcher`).
        """
        if self.fault is not None:
            raise RuntimeError(f"the engine stopped after a fault: {type(self.fault).__name__}: {self.fault}")
        if not prompt_ids:
            raise InputError("the prompt is empty: it encodes to zero tokens")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.context_len:
            raise InputError(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_tokens} exceeds the model's "
                f"context of {self.context_len} tokens; shorten the prompt or lower max_tokens"
            )
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        if params.min_tokens and len(stop_ids) > MAX_SUPPRESSED:
            raise InputError(f"min_tokens={params.min_tokens} holds back at most {MAX_SUPPRESSED} stop tokens; this "
                             f"request has {len(stop_ids)} (stop_token_ids and end of sequence)")
        if params.n != 1:
            raise InputError(f"n={params.n}: the engine takes one sample a request; submit each of "
                             "SamplingParams.children()")
        if params.grammar is not None and not getattr(self.runner, "constrains", False):
            raise InputError("this engine cannot constrain decoding (structured output): its runner has no masked "
                             "sampler (a multi-host group does not serve it yet)")
        if params.grammar is not None and matcher is None:
            matcher = self.grammars.matcher(params.grammar)
        request = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, next(self._arrivals),
                          frozenset(stop_ids), priority=priority, deadline=deadline, matcher=matcher)
        self.scheduler.check_fits(request)
        if on_update is None:
            box: queue.SimpleQueue[Update] = queue.SimpleQueue()
            self._outboxes[request.request_id] = box
            on_update = box.put
        self._sinks[request.request_id] = on_update
        self._requests[request.request_id] = request  # so that a cancel right after submit is not lost
        self._inbox.put(("add", request))
        return request

    def cancel(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._inbox.put(("cancel", request))

    def outbox(self, request_id: str) -> queue.SimpleQueue[Update]:
        return self._outboxes[request_id]

    def close_outbox(self, request_id: str) -> None:
        """Forgets a request's outbox (or `on_update`) once its reader is done with it (a server calls this per
        request)."""
        self._outboxes.pop(request_id, None)
        self._sinks.pop(request_id, None)

    def run_until_done(self) -> None:
        """Steps on the caller's thread until every submitted request has finished."""
        self._drain_inbox()
        while self.busy:
            self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[Request]:
        """Submits every prompt, runs them batched to completion, returns the finished requests in order."""
        requests = [self.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        self.run_until_done()
        for r in requests:
            self.close_outbox(r.request_id)
        return requests

    def start(self) -> None:
        """Runs the loop on a background thread until `stop`."""
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))  # type: ignore[arg-type]
        if self._thread is not None:
            self._thread.join()
        if self._mask_thread is not None:
            self._mask_thread.shutdown()

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.busy:
                    self._handle(*self._inbox.get())
                self._drain_inbox()
                if self.busy:
                    self.step()
        except Exception as e:  # any failure of a step ends the loop; it is reported, not lost
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        """Ends every request in flight with "error", records the fault and tells the listeners."""
        log.error("engine step failed; failing %d requests in flight and stopping", len(self._requests),
                  exc_info=error)
        self.fault = error
        self._stopping.set()
        for listener in self.on_fault:  # first, so that a caller who sees its error also sees the fault
            listener(error)
        message = f"engine step failed: {type(error).__name__}: {error}"
        self._drain_inbox()
        for request in list(self._requests.values()):
            if not request.finished:
                self._end_with_error(request, message)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._handle(*self._inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, kind: str, request: Request) -> None:
        if kind == "add" and self.fault is not None:
            self._end_with_error(request, "the engine stopped after a fault")
        elif kind == "add":
            self._requests[request.request_id] = request
            self._detok[request.request_id] = IncrementalDetokenizer(self.tokenizer)
            self.scheduler.add(request)
        elif kind == "cancel" and not request.finished:
            self.scheduler.abort(request)
            self._emit(request, [], "", [])

    def step(self) -> None:
        """One iteration: plan and dispatch step N+1, then read and postprocess step N.

        Step N+1 is planned as if step N had gone as far as it could (see Scheduler); its decode
        rows take their input tokens from step N's samples on the device. A request that step N
        finishes (a stop token, a stop string) wastes its row in step N+1, which writes only into
        its own pages and whose result is dropped.

        Step N+1's inputs are built before step N's masked sampler, if it has one, is enqueued: the host's planning
        then overlaps step N's forward, and step N+1 is enqueued right behind that sampler.
        """
        self._drain_inbox()
        self._drop_expired()
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        planned = time.perf_counter()
        built = None if plan.empty else self._build(plan)
        self.stats.schedule_s += planned - start
        self.stats.dispatch_s += time.perf_counter() - planned
        if self._in_flight is not None:
            self._constrain(self._in_flight)
        enqueue = time.perf_counter()
        launched = None if built is None else [self._dispatch(*b) for b in built]
        self.stats.dispatch_s += time.perf_counter() - enqueue
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._complete(previous)
        if launched is not None:
            self._start_masks(launched)

    def _drop_expired(self) -> None:
        """Aborts the waiting requests past their deadline: their callers are gone, and a prefill for them would
        cost the others a step (the cancellation their call sends may not have arrived yet)."""
        now = time.monotonic()
        for request in [r for r in self.scheduler.waiting if r.deadline is not None and r.deadline <= now]:
            self.scheduler.abort(request)
            self._emit(request, [], "", [])

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def _build(self, plan: StepPlan) -> list[tuple[list[Chunk | None], StepInput, bool]]:
        """The plan's dispatches, built on the host and not yet enqueued: its prefill chunk, its decode rows and its
        verify rows -> (rows, their input, whether it is a verify step) each."""
        self.stats.steps += 1
        built = []
        if plan.prefill:
            chunks: list[Chunk | None] = list(plan.prefill)
            chunks += [None] * (self.cfg.prefill_rows_for(plan.prefill_width, len(chunks)) - len(chunks))
            built.append((chunks, StepInput.build(chunks, plan.prefill_width, self.cfg.max_pages_per_slot,
                                                  self.cfg.max_slots), False))
            self.stats.prefill_steps += 1
        if plan.decode:
            rows: list[Chunk | None] = [None] * self.cfg.decode_rows_for(max(c.request.slot or 0 for c in plan.decode) + 1)
            for chunk in plan.decode:
                assert chunk.request.slot is not None
                rows[chunk.request.slot] = chunk
            pages = self.cfg.decode_pages_for(max(len(c.request.pages) for c in plan.decode))
            built.append((rows, StepInput.build(rows, 1, pages, self.cfg.max_slots), False))
            self.stats.decode_steps += 1
            self.stats.max_decode_rows = max(self.stats.max_decode_rows, len(plan.decode))
        if plan.verify:
            assert self.cfg.speculative is not None
            verify: list[Chunk | None] = list(plan.verify)
            verify += [None] * (self.cfg.decode_rows_for(len(verify)) - len(verify))
            built.append((verify, StepInput.build(verify, self.cfg.speculative.num_tokens + 1,
                                                  self.cfg.max_pages_per_slot, self.cfg.max_slots), True))
        return built

    def _dispatch(self, rows: list[Chunk | None], inp: StepInput,
                  verify: bool) -> tuple[list[Chunk | None], Callable[[], StepOutput]]:
        """Enqueues one built dispatch; no result is read here."""
        if self.draft is not None:  # the draft model's K/V follows every step's tokens, in pages of its own
            self.draft.dispatch(inp, verify=True) if verify else self.draft.dispatch(inp)
        if any(c is not None and c.sample and c.request.matcher is not None for c in rows):
            return rows, _Unmasked(self.runner.dispatch_constrained(inp))
        return rows, self.runner.dispatch(inp, verify=True) if verify else self.runner.dispatch(inp)  # (fakes take one)

    def _draft_proposals(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """Drafts from the draft model: up to k greedy tokens after each request's last one, every request a decode
        row at its slot, k draft steps back to back (each step's tokens fed on the device), read once at the end."""
        assert self.draft is not None
        rows: list[Chunk | None] = [None] * self.cfg.decode_rows_for(max(r.slot or 0 for r, _ in items) + 1)
        room = np.zeros(len(rows), np.int32)
        for request, k in items:
            assert request.slot is not None
            rows[request.slot], room[request.slot] = Chunk(request, request.num_tokens - 1, 1), k
        pages = self.cfg.decode_pages_for(max(len(r.pages) for r, _ in items))
        inp = StepInput.build(rows, 1, pages, self.cfg.max_slots).greedy()
        steps = [self.draft.dispatch(inp)]
        for i in range(1, int(room.max())):
            # the next position of every row, its token the draft's own last sample (fed on the device); a row with
            # fewer drafts to make turns to padding (its pages end where its drafts do)
            done = room <= i
            inp = replace(inp, positions=inp.positions + 1, feed=~done, valid=inp.valid & ~done[:, None],
                          slots=np.where(done, self.cfg.max_slots, inp.slots).astype(np.int32))
            steps.append(self.draft.dispatch(inp))
        tokens = [result().tokens for result in steps]
        return [[int(tokens[i][r.slot]) for i in range(k)] for r, k in items]  # type: ignore[index]

    def _complete(self, dispatched: Dispatched) -> None:
        """Reads a dispatched step back (one copy per dispatch) and commits every row of it."""
        start = time.perf_counter()
        outputs = [(rows, result()) for rows, result in dispatched]
        read = time.perf_counter()
        self.stats.device_wait_s += read - start
        for rows, out in outputs:
            tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()  # Python numbers, once for every row
            for i, chunk in enumerate(rows):
                if chunk is None:
                    continue
                if out.prompt is not None and chunk.request.params.prompt_logprobs is not None:
                    self._record_prompt_logprobs(chunk, out.prompt[i])
                if out.counts is not None:
                    self._commit_verify(chunk, out, i)
                else:
                    self._commit(chunk, out, i, tokens[i], logprobs[i])
        self.stats.commit_s += time.perf_counter() - read

    @staticmethod
    def _record_prompt_logprobs(chunk: Chunk, values: np.ndarray) -> None:
        """The prompt log-probabilities a prefill chunk computed (StepOutput.prompt's row): position p's logits
        give token p + 1's entry. A chunk recomputed after a preemption writes the same entries again."""
        request = chunk.request
        prompt = len(request.prompt_ids)
        if not request.prompt_logprobs:
            request.prompt_logprobs = [None] * prompt
        k = request.params.prompt_logprobs or 0
        for j in range(max(0, min(chunk.length, prompt - 1 - chunk.start))):
            entry = values[j]
            top = [(int(t), float(lp)) for t, lp in zip(entry[1:1 + k], entry[1 + NUM_TOP:1 + NUM_TOP + k])]
            request.prompt_logprobs[chunk.start + j + 1] = (float(entry[0]), top)

    def _commit(self, chunk: Chunk, out: StepOutput, row: int, token: int, logprob: float) -> None:
        request = chunk.request
        if not chunk.sample or request.finished:
            self.scheduler.commit(chunk, None)
            return
        if not math.isfinite(logprob):
            # Nothing is committed: its pages must not enter the prefix cache.
            self._end_with_error(request, f"the logits turned non-finite at position {request.num_tokens}")
            return
        logprobs = []
        if request.params.logprobs:
            n = request.params.logprobs
            top = [(int(i), float(lp)) for i, lp in zip(out.top_ids[row, :n], out.top_logprobs[row, :n])]
            logprobs = [(logprob, top)]
            request.logprobs.extend(logprobs)
        first = not request.output_ids
        request.token_times.append(time.perf_counter())
        self.scheduler.commit(chunk, token)
        if request.matcher is not None and not self._follow_grammar(request, token):
            return
        text = self._detok[request.request_id].push(token)
        if request.finished:
            text += self._detok[request.request_id].flush()
        text = self._apply_stop_strings(request, text)[0]
        prompt = request.prompt_logprobs if first and request.params.prompt_logprobs is not None else None
        self._emit(request, [token], text, logprobs, prompt_logprobs=prompt)

    def _commit_verify(self, chunk: Chunk, out: StepOutput, row: int) -> None:
        """A verify row's result: its emitted tokens are kept up to a stop token, max_tokens or a stop string (the
        text and the tokens end exactly where they would without speculation), and sent as one update."""
        request = chunk.request
        assert out.counts is not None
        count = int(out.counts[row])
        self.spec.add(len(chunk.drafts), count - 1)
        emitted = out.tokens[row, :count].tolist()
        chosen = out.logprobs[row, :count].tolist()
        if request.finished:
            self.scheduler.commit_verify(chunk, [])
            return
        bad = next((i for i, lp in enumerate(chosen) if not math.isfinite(lp)), None)
        if bad is not None:
            self._end_with_error(request, f"the logits turned non-finite at position {request.num_tokens + bad}")
            return
        kept = self.scheduler.commit_verify(chunk, emitted)
        detok = self._detok[request.request_id]
        text, logprobs, now = "", [], time.perf_counter()
        for i, token in enumerate(kept):
            if request.params.logprobs:
                n = request.params.logprobs
                top = [(int(t), float(lp)) for t, lp in zip(out.top_ids[row, i, :n], out.top_logprobs[row, i, :n])]
                logprobs.append((chosen[i], top))
            request.token_times.append(now)
            delta = detok.push(token) + (detok.flush() if request.finished and i == len(kept) - 1 else "")
            emitted_text, hit = self._apply_stop_strings(request, delta)
            text += emitted_text
            if hit:  # a stop string ended it here: what followed was never generated
                del request.output_ids[len(request.output_ids) - (len(kept) - 1 - i):]
                kept = kept[:i + 1]
                break
        request.logprobs.extend(logprobs)
        first = len(request.output_ids) == len(kept)
        prompt = request.prompt_logprobs if first and request.params.prompt_logprobs is not None else None
        self._emit(request, kept, text, logprobs, prompt_logprobs=prompt)

    def _start_masks(self, dispatched: Dispatched) -> None:
        """Starts computing the masks of each dispatch in flight with constrained rows, off the engine thread. The
        step before it has been read, so each row's matcher holds every token before the one this step samples; no
        matcher is fed again until `_constrain` has the masks."""
        for rows, result in dispatched:
            if isinstance(result, _Unmasked):
                matchers = [c.request.matcher if c is not None and c.sample and not c.request.finished else None
                            for c in rows]
                if self._mask_thread is None:
                    self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-masks")
                result.masks = self._mask_thread.submit(self._masks, matchers)

    def _masks(self, matchers: list[Any]) -> np.ndarray:
        start = time.perf_counter()
        masks = self.grammars.masks(matchers)
        self.stats.mask_s += time.perf_counter() - start
        self.stats.masked_steps += 1
        return masks

    def _constrain(self, dispatched: Dispatched) -> None:
        """Enqueues the masked sampler of each dispatch in flight with constrained rows, once its masks are done."""
        for i, (rows, result) in enumerate(dispatched):
            if isinstance(result, _Unmasked):
                assert result.masks is not None
                dispatched[i] = (rows, result.sample(result.masks.result()))

    def _follow_grammar(self, request: Request, token: int) -> bool:
        """Feeds a constrained request's matcher its token; finishes the request ("stop") where the grammar ends.
        False (the request ended with an error) if the grammar refuses the token, which a masked draw never gives
        unless every token was masked (min_tokens holding back the only one the grammar allows, say)."""
        if not request.matcher.consume_token(token):
            self._end_with_error(request, f"token {token} does not follow the request's grammar: "
                                          f"{request.matcher.get_error()[:200]}")
            return False
        if request.matcher.is_stopped() and not request.finished:
            self.scheduler.finish(request, "stop")
        return True

    def _end_with_error(self, request: Request, message: str) -> None:
        """Frees the request's slot and pages and sends its last Update, with finish_reason "error"."""
        self.scheduler.abort(request)
        request.finish_reason = "error"
        self._emit(request, [], "", [], error=message)

    def _apply_stop_strings(self, request: Request, delta: str) -> tuple[str, bool]:
        """Cuts the text at the first stop string and finishes the request there -> (the delta's text up to it,
        whether a stop string was found)."""
        stops = request.params.stop
        if len(request.output_ids) < request.params.min_tokens:  # (vLLM's: the min_tokens-th token's text may stop)
            stops = ()
        if not stops or not delta:
            request.text += delta
            return delta, False
        longest = max(len(s) for s in stops)
        window_start = max(0, len(request.text) - longest + 1)
        combined = request.text + delta
        hits = [i for i in (combined.find(s, window_start) for s in stops) if i >= 0]
        if not hits:
            request.text = combined
            return delta, False
        cut = min(hits)
        emitted = combined[len(request.text):cut] if cut > len(request.text) else ""
        request.text = combined[:cut]
        if not request.finished:
            self.scheduler.finish(request, "stop")
        else:
            request.finish_reason = "stop"
        return emitted, True

    def _emit(self, request: Request, ids: list[int], text: str, logprobs: list, error: str | None = None, *,
              prompt_logprobs: list | None = None) -> None:
        sink = self._sinks.get(request.request_id)
        if sink is not None:
            sink(Update(request.request_id, ids, text, logprobs, request.finish_reason if request.finished else None,
                        error, prompt_logprobs))
        if request.finished:
            self._requests.pop(request.request_id, None)
            self._detok.pop(request.request_id, None)
