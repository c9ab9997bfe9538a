"""What every serving surface (gRPC, HTTP) shares over one engine: limits, admission, tokenizing off the event loop,
and a request's updates as an async stream on the caller's loop.

Admission counts the requests the engine holds: submitted and not yet finished there (`capacity`: the engine's
slots plus `max_waiting`). A request whose output is complete no longer counts, however slowly its client reads
it; one whose buffered output passes `stream_buffer_tokens` is cancelled in the engine at once. The counts are
guarded by one lock, because each surface runs its own event loop and the drain runs on the main thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve.config import SamplingParams, ServerConfig
from jaxserve.engine import validation
from jaxserve.engine.engine import Engine, Update
from jaxserve.engine.request import Request
from jaxserve.engine.validation import InvalidArgument, Limits
from jaxserve.errors import InputError

log = logging.getLogger(__name__)

_TOKENIZER_THREADS = 4
TEMPLATE_TIMEOUT_S = 10.0


class Refused(Exception):
    """A request the server will not take now; `kind` is "unavailable" (loading, draining, faulted) or "full"
    (retry after `retry_after_ms`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Ended(Exception):
    """A stream the server ended before its request finished; `kind` is "drained" (shut down past the drain
    timeout), "behind" (fell more than stream_buffer_tokens behind), "deadline" (dropped unscheduled) or "error"
    (the engine failed it)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Frontend:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.engine: Engine | None = None
        self.limits: Limits | None = None
        self._lock = threading.Condition()
        self._calls: set[str] = set()  # streams admitted and not yet ended
        self._held: dict[str, float] = {}  # of those, the requests the engine holds: their deadline (monotonic)
        self._forced: set[str] = set()  # requests cancelled by the drain rather than by their caller
        self._draining = False
        self._pool = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="jaxserve-tokenize")

    def attach(self, engine: Engine) -> None:
        self.limits = Limits.of(engine, self.cfg)
        self.engine = engine

    @property
    def capacity(self) -> int:
        return self.cfg.engine.max_slots + self.cfg.max_waiting

    @property
    def held(self) -> int:
        """Requests the engine holds for a stream: submitted (or about to be) and not finished there."""
        with self._lock:
            return len(self._held)

    @property
    def in_flight(self) -> int:
        """Streams admitted and not yet ended."""
        with self._lock:
            return len(self._calls)

    def ready(self, *, draining_ok: bool = False) -> tuple[Engine, Limits]:
        if self._draining and not draining_ok:
            raise Refused("unavailable", "the server is draining (shutting down); retry on another replica")
        if self.engine is None or self.limits is None:
            raise Refused("unavailable", "the model is still loading and compiling; retry shortly")
        if self.engine.fault is not None:
            raise Refused("unavailable", f"the engine stopped after a fault ({type(self.engine.fault).__name__}); "
                                         "this replica must be restarted")
        return self.engine, self.limits

    # -- input ----------------------------------------------------------------------------------
    async def encode_text(self, text: Any, name: str = "prompt") -> list[int]:
        engine, limits = self.ready(draining_ok=True)
        checked = validation.prompt_text(text, limits, name)
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, engine.tokenizer.encode, checked)
        return self._room(ids, name, limits)

    async def encode_chat(self, messages: Any, name: str = "messages",
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat's token ids, `tools` (validation.tools') passed to the template; the template's output is bounded
        (twice max_prompt_bytes) and so is its time (TEMPLATE_TIMEOUT_S: the caller is answered then, though a
        render thread cannot be stopped)."""
        engine, limits = self.ready(draining_ok=True)
        chat = validation.messages(messages, limits, name)
        render = asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: engine.tokenizer.encode_chat(chat, max_bytes=2 * limits.max_prompt_bytes, tools=tools))
        try:
            ids = await asyncio.wait_for(render, TEMPLATE_TIMEOUT_S)
        except TimeoutError:
            log.warning("the chat template ran over %s s on a request's %d messages", TEMPLATE_TIMEOUT_S, len(chat))
            raise InvalidArgument(f"the chat template took over {TEMPLATE_TIMEOUT_S} s on these messages") from None
        except InputError as e:
            log.warning("chat template failed: %s", e)  # one line: the caller gets the same as INVALID_ARGUMENT
            raise
        return self._room(ids, name, limits)

    async def constraint(self, kind: str, value: Any, name: str) -> str:
        """A structured-output constraint's grammar (validation.constraint), compiled off the event loop: a large
        schema takes milliseconds."""
        self.ready(draining_ok=True)
        return await asyncio.get_running_loop().run_in_executor(self._pool, validation.constraint, kind, value, name)

    def token_ids(self, ids: Any, name: str = "token_ids") -> list[int]:
        return validation.token_ids(ids, self.ready(draining_ok=True)[1], name)

    async def decode(self, ids: Sequence[int]) -> str:
        engine, _ = self.ready(draining_ok=True)
        return await asyncio.get_running_loop().run_in_executor(self._pool, engine.tokenizer.decode, list(ids))

    @staticmethod
    def _room(ids: list[int], name: str, limits: Limits) -> list[int]:
        if not ids:
            raise InvalidArgument(f"{name} encodes to zero tokens; send a non-empty input")
        if len(ids) > limits.room:
            raise InvalidArgument(f"{name} encodes to {len(ids)} tokens; this server holds at most {limits.room} per "
                                  "sequence")
        return list(ids)

    # -- streams --------------------------------------------------------------------------------
    async def generate(self, ids: list[int], params: SamplingParams, *, priority: int = 0,
                       timeout: float | None = None) -> AsyncGenerator[tuple[Request, Update], None]:
        """Admits and submits one request, then yields (request, update) until its last update. Raises Refused
        before anything is submitted, InvalidArgument if the engine cannot take it, Ended if the server ends it.
        Closing the iterator early (the client went away, its deadline passed) cancels the request in the engine:
        its slot and pages are free within one step."""
        engine, _ = self.ready()
        engine_id = uuid.uuid4().hex
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        self._admit(engine_id, now, deadline)
        loop = asyncio.get_running_loop()
        buffer: asyncio.Queue[Update] = asyncio.Queue()
        buffered = [0]  # tokens delivered and not yet taken
        behind: list[bool] = []

        def deliver(update: Update) -> None:  # on the loop
            buffered[0] += len(update.token_ids)
            if update.finish_reason is not None:
                self._release(engine_id)  # the engine is done with it, whether or not its client has read it
            elif buffered[0] > self.cfg.stream_buffer_tokens and not behind:
                behind.append(True)
                engine.cancel(engine_id)  # (its place is released by the update that ends it)
            buffer.put_nowait(update)

        def on_update(update: Update) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads this stream any more
                loop.call_soon_threadsafe(deliver, update)

        try:
            # a constrained request's matcher is made off the loop: the first one builds llguidance's tokenizer
            matcher = None if params.grammar is None else await loop.run_in_executor(
                self._pool, engine.grammars.matcher, params.grammar)
            request = engine.submit(ids, params, engine_id, priority=priority, on_update=on_update, deadline=deadline,
                                    matcher=matcher)
            while True:
                update = await buffer.get()
                buffered[0] -= len(update.token_ids)
                if update.error is not None:
                    raise Ended("error", update.error)
                if update.finish_reason == "abort":
                    if engine_id in self._forced:
                        raise Ended("drained", f"the server shut down after its drain timeout of "
                                               f"{self.cfg.drain_timeout_s} s before the request finished")
                    if behind:
                        raise Ended("behind", f"the stream fell more than stream_buffer_tokens="
                                              f"{self.cfg.stream_buffer_tokens} tokens behind: read it faster")
                    raise Ended("deadline", "the deadline passed before the request was scheduled")
                yield request, update
                if update.finish_reason is not None:
                    return
        finally:  # done, failed, or closed early: by its client, its deadline, or the surface (CancelledError)
            engine.close_outbox(engine_id)
            self.end(engine_id)

    async def generate_many(self, children: Sequence[tuple[list[int], SamplingParams]], *, priority: int = 0,
                            timeout: float | None = None) -> AsyncGenerator[tuple[int, Request, Update], None]:
        """Streams several requests together (the n samples of a prompt, or several prompts): (index into
        `children`, request, update) as they come, until every one has finished. The first failure (Refused, Ended,
        InputError) is raised and cancels the others, as closing the iterator does. Each child waits for its update
        to be taken before it reads the next, so a slow reader still holds each request's output in its own buffer
        (stream_buffer_tokens) and its place in flight."""
        if len(children) == 1:
            async with contextlib.aclosing(self.generate(*children[0], priority=priority, timeout=timeout)) as one:
                async for request, update in one:
                    yield 0, request, update
            return
        events: asyncio.Queue[tuple[int, Any, Any]] = asyncio.Queue(maxsize=1)

        async def child(index: int, ids: list[int], params: SamplingParams) -> None:
            try:
                async with contextlib.aclosing(self.generate(ids, params, priority=priority, timeout=timeout)) as stream:
                    async for request, update in stream:
                        await events.put((index, request, update))
            except (Refused, Ended, InputError) as e:
                await events.put((index, None, e))
            finally:
                await events.put((index, None, None))  # this child is done

        tasks = [asyncio.create_task(child(i, ids, params)) for i, (ids, params) in enumerate(children)]
        try:
            left = len(tasks)
            while left:
                index, request, update = await events.get()
                if request is None and update is None:
                    left -= 1
                elif request is None:
                    raise update
                else:
                    yield index, request, update
        finally:
            for task in tasks:
                task.cancel()

    def end(self, engine_id: str) -> None:
        """Frees a stream's place and its admission now (a surface calls this before it waits on a client that
        may never read again)."""
        if self.engine is not None:
            self.engine.cancel(engine_id)
        self._release(engine_id, ended=True)

    def _admit(self, engine_id: str, now: float, deadline: float | None) -> None:
        with self._lock:
            # A call past its deadline is over for its client, whether or not its cancellation has run yet
            for expired in [i for i, d in self._held.items() if d <= now]:
                del self._held[expired]
            if self._draining:
                raise Refused("unavailable", "the server is draining (shutting down); retry on another replica")
            if len(self._held) >= self.capacity:
                raise Refused("full", f"the waiting queue is full ({self.cfg.engine.max_slots} running slots and "
                                      f"max_waiting={self.cfg.max_waiting} are taken); retry after "
                                      f"{self.cfg.retry_after_ms} ms")
            self._calls.add(engine_id)
            self._held[engine_id] = math.inf if deadline is None else deadline

    def _release(self, engine_id: str, *, ended: bool = False) -> None:
        with self._lock:
            self._held.pop(engine_id, None)
            if ended:
                self._calls.discard(engine_id)
                self._forced.discard(engine_id)
                self._lock.notify_all()

    # -- drain (from any thread) ------------------------------------------------------------------
    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no stream is in flight; False if some still are after `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._calls, timeout=timeout)

    def abort_in_flight(self) -> None:
        """Cancels every request still streaming; their streams end with Ended("drained")."""
        with self._lock:
            ids = list(self._calls)
            self._forced.update(ids)
        for request_id in ids:
            if self.engine is not None:
                self.engine.cancel(request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
