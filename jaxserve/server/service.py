"""InferenceService: validates, admits and streams requests through one engine.

Concurrency. The service runs on one asyncio event loop (grpc.aio): a call is a coroutine, never a thread, so a
client that stops reading its stream holds no thread and no admission place. Tokenizing and rendering chat
templates run on a small thread pool, so a large prompt never stalls the loop. The engine thread hands each
request's updates to the loop (`Engine.submit(on_update=...)`), where they wait in the call's buffer.

Admission counts the requests the engine holds: submitted and not yet finished there. A request whose output is
complete no longer counts, however slowly its client reads it. A stream that cannot write for
`stream_idle_timeout_s` is cancelled, and so is one whose buffered output passes `stream_buffer_tokens`
(RESOURCE_EXHAUSTED). A cancelled call or an expired deadline cancels the call's coroutine at once, which cancels
its request in the engine: the slot and pages are free within one engine step.

Drain. `begin_drain` (any thread) refuses new calls with UNAVAILABLE; `wait_idle` waits for in-flight calls;
`abort_in_flight` cancels whatever is left, whose streams then end with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from jaxserve.config import ServerConfig
from jaxserve.engine import validation
from jaxserve.engine.engine import Engine, Update
from jaxserve.engine.validation import InvalidArgument, Limits
from jaxserve.errors import InputError
from jaxserve.server.metrics import Metrics
from jaxserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.v1.InferenceService"
RETRY_AFTER_KEY = "retry-after-ms"
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_TOKENIZER_THREADS = 4
M = TypeVar("M")


class InferenceServicer:
    """The three RPCs over an engine that is attached once the model is loaded and compiled."""

    def __init__(self, cfg: ServerConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.engine: Engine | None = None
        self.limits: Limits | None = None
        self.info = pb.ModelInfo()
        self._lock = threading.Condition()  # the counts below are read from the serving thread (drain) too
        self._calls: set[str] = set()  # Generate calls admitted and not yet ended
        self._held: dict[str, float] = {}  # of those, the requests the engine holds (admission counts these): deadline
        self._forced: set[str] = set()  # requests cancelled by the drain rather than by their caller
        self._draining = False
        self._pool = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="jaxserve-tokenize")

    @property
    def in_flight(self) -> int:
        """Generate calls admitted and not yet finished."""
        with self._lock:
            return len(self._calls)

    @property
    def held(self) -> int:
        """Requests the engine holds for a call: submitted (or about to be) and not finished there."""
        with self._lock:
            return len(self._held)

    @property
    def capacity(self) -> int:
        """Requests the engine may hold at once: its slots plus the waiting-queue bound."""
        return self.cfg.engine.max_slots + self.cfg.max_waiting

    def attach(self, engine: Engine, info: pb.ModelInfo) -> None:
        self.info = info
        self.limits = Limits.of(engine, self.cfg)
        self.engine = engine

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers. Requests arrive as bytes and are parsed here, so that one that is not a
        valid message (a string field that is not UTF-8, say) gets INVALID_ARGUMENT, not INTERNAL."""
        def handler(method: Any, kind: Callable[..., grpc.RpcMethodHandler], response: Any) -> grpc.RpcMethodHandler:
            return kind(method, request_deserializer=None, response_serializer=response.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": handler(self.Generate, grpc.unary_stream_rpc_method_handler, pb.GenerateResponse),
            "Tokenize": handler(self.Tokenize, grpc.unary_unary_rpc_method_handler, pb.TokenizeResponse),
            "GetModelInfo": handler(self.GetModelInfo, grpc.unary_unary_rpc_method_handler, pb.ModelInfo),
        })

    # -- drain (from any thread) ---------------------------------------------------------------
    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no Generate call is in flight; False if some still are after `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._calls, timeout=timeout)

    def abort_in_flight(self) -> None:
        """Cancels every request still streaming; their calls end with UNAVAILABLE."""
        with self._lock:
            ids = list(self._calls)
            self._forced.update(ids)
        for request_id in ids:
            if self.engine is not None:
                self.engine.cancel(request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- RPCs --------------------------------------------------------------------------------
    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        request = await _parse(raw, pb.GenerateRequest, context)
        engine, limits = await self._ready(context)
        try:
            reply_id = validation.request_id(request.request_id)
            params = _sampling(request, limits)
            ids = await self._prompt_ids(request, engine, limits)
            validation.fits(len(ids), params, limits, "sampling.max_tokens")
        except InputError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        engine_id = uuid.uuid4().hex
        reply_id = reply_id or engine_id
        await self._admit(engine_id, context)
        loop = asyncio.get_running_loop()
        buffer: asyncio.Queue[Update] = asyncio.Queue()
        buffered = [0]  # tokens delivered and not yet written
        overflowed: list[bool] = []  # set once the stream has fallen too far behind

        def deliver(update: Update) -> None:  # on the loop
            buffered[0] += len(update.token_ids)
            if update.finish_reason is not None:
                self._release(engine_id)  # the engine is done with it, whether or not its client has read it
            elif buffered[0] > self.cfg.stream_buffer_tokens and not overflowed:
                overflowed.append(True)
                engine.cancel(engine_id)  # (its place is released by the update that ends it)
            buffer.put_nowait(update)

        def on_update(update: Update) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the server's loop has closed: nobody reads this stream any more
                loop.call_soon_threadsafe(deliver, update)

        try:
            try:
                remaining = context.time_remaining()
                submitted = engine.submit(ids, params, engine_id, priority=request.priority, on_update=on_update,
                                          deadline=None if remaining is None else time.monotonic() + remaining)
            except InputError as e:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.metrics.prompt_tokens.inc(len(ids))
            first = True
            while True:
                update = await buffer.get()
                buffered[0] -= len(update.token_ids)
                if update.error is not None:
                    await _abort(context, grpc.StatusCode.INTERNAL, update.error)
                if update.finish_reason == "abort":
                    if engine_id in self._forced:
                        await _abort(context, grpc.StatusCode.UNAVAILABLE,
                                     f"the server shut down after its drain timeout of {self.cfg.drain_timeout_s} s "
                                     "before the request finished")
                    if overflowed:
                        await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"the stream fell more than stream_buffer_tokens={self.cfg.stream_buffer_tokens} "
                                     "tokens behind: read it faster")
                    await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "the deadline passed before the request was scheduled")
                if update.token_ids:
                    if first:
                        self.metrics.first_token(submitted)
                        first = False
                    self.metrics.generation_tokens.inc(len(update.token_ids))
                    await self._write(context, pb.GenerateResponse(request_id=reply_id, chunk=_chunk(update)), engine,
                                      engine_id)
                if update.finish_reason is not None:
                    self.metrics.finished(submitted)
                    usage = pb.Usage(prompt_tokens=len(submitted.prompt_ids),
                                     completion_tokens=len(submitted.output_ids), cached_tokens=submitted.cached_tokens)
                    await self._write(context, pb.GenerateResponse(request_id=reply_id, completion=pb.Completion(
                        finish_reason=_FINISH_REASONS[update.finish_reason], usage=usage)), engine, engine_id)
                    return
        finally:  # the call ended: done, failed, cancelled by its client or past its deadline (CancelledError)
            engine.cancel(engine_id)
            engine.close_outbox(engine_id)
            self._release(engine_id, ended=True)

    async def Tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        request = await _parse(raw, pb.TokenizeRequest, context)
        engine, limits = await self._ready(context, draining_ok=True)
        try:
            ids = await self._prompt_ids(request, engine, limits)
        except InputError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await _parse(raw, pb.GetModelInfoRequest, context)
        await self._ready(context, draining_ok=True)
        return self.info

    # -- helpers -----------------------------------------------------------------------------
    async def _ready(self, context: grpc.aio.ServicerContext, *, draining_ok: bool = False) -> tuple[Engine, Limits]:
        if self._draining and not draining_ok:
            await _abort(context, grpc.StatusCode.UNAVAILABLE,
                         "the server is draining (shutting down); retry on another replica")
        if self.engine is None or self.limits is None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "the model is still loading and compiling; retry shortly")
        if self.engine.fault is not None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, f"the engine stopped after a fault "
                         f"({type(self.engine.fault).__name__}); this replica must be restarted")
        return self.engine, self.limits

    async def _prompt_ids(self, request: pb.GenerateRequest | pb.TokenizeRequest, engine: Engine,
                          limits: Limits) -> list[int]:
        """The input's token ids: sizes checked here, the tokenizer and chat template run on the pool."""
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("the request has no input: set one of prompt, token_ids or messages")
        if kind == "token_ids":
            return validation.token_ids(list(request.token_ids.ids), limits, "token_ids.ids")  # type: ignore[union-attr]
        loop = asyncio.get_running_loop()
        tok = engine.tokenizer
        if kind == "prompt":
            text = validation.prompt_text(request.prompt, limits)
            ids = await loop.run_in_executor(self._pool, tok.encode, text)
        else:
            chat = validation.messages([{"role": m.role, "content": m.content} for m in request.messages.messages],
                                       limits, "messages.messages")
            ids = await loop.run_in_executor(self._pool, lambda: tok.encode_chat(chat, max_bytes=2 * limits.max_prompt_bytes))
        if not ids:
            raise InvalidArgument(f"{kind} encodes to zero tokens; send a non-empty input")
        if len(ids) > limits.room:
            raise InvalidArgument(f"{kind} encodes to {len(ids)} tokens; this server holds at most {limits.room} per "
                                  "sequence")
        return list(ids)

    async def _admit(self, engine_id: str, context: grpc.aio.ServicerContext) -> None:
        now = time.monotonic()
        remaining = context.time_remaining()
        with self._lock:
            # A call past its deadline is over for its client, whether or not its cancellation has run yet
            for expired in [i for i, deadline in self._held.items() if deadline <= now]:
                del self._held[expired]
            draining, full = self._draining, len(self._held) >= self.capacity
            if not (draining or full):
                self._calls.add(engine_id)
                self._held[engine_id] = math.inf if remaining is None else now + remaining
        if draining:
            await _abort(context, grpc.StatusCode.UNAVAILABLE,
                         "the server is draining (shutting down); retry on another replica")
        if full:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(self.cfg.retry_after_ms)),))
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the waiting queue is full ({self.cfg.engine.max_slots} running slots and max_waiting="
                         f"{self.cfg.max_waiting} are taken); retry after {self.cfg.retry_after_ms} ms")

    def _release(self, engine_id: str, *, ended: bool = False) -> None:
        with self._lock:
            self._held.pop(engine_id, None)
            if ended:
                self._calls.discard(engine_id)
                self._forced.discard(engine_id)
                self._lock.notify_all()

    async def _write(self, context: grpc.aio.ServicerContext, response: pb.GenerateResponse, engine: Engine,
                     engine_id: str) -> None:
        try:
            await asyncio.wait_for(context.write(response), self.cfg.stream_idle_timeout_s)
        except TimeoutError:
            log.warning("a stream was not read for stream_idle_timeout_s=%s s: cancelled", self.cfg.stream_idle_timeout_s)
            # The status cannot pass the unsent output ahead of it (HTTP/2 flow control holds both): the request and
            # the call's place are freed now, and the client sees the status once it reads what is queued.
            engine.cancel(engine_id)
            self._release(engine_id, ended=True)
            await _abort(context, grpc.StatusCode.CANCELLED,
                         f"the stream was not read for stream_idle_timeout_s={self.cfg.stream_idle_timeout_s} s")


def _sampling(request: pb.GenerateRequest, limits: Limits) -> Any:
    s = request.sampling
    names = {key: f"sampling.{key}" for key in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                                 "stop_token_ids", "ignore_eos", "logprobs")}
    return validation.sampling(limits, max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
                               temperature=s.temperature, top_k=s.top_k,
                               top_p=s.top_p if s.HasField("top_p") else 1.0, seed=s.seed, stop=list(s.stop),
                               stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs,
                               names=names)


async def _parse(raw: bytes, message: type[M], context: grpc.aio.ServicerContext) -> M:
    try:
        return message.FromString(raw)  # type: ignore[attr-defined, no-any-return]
    except DecodeError as e:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"the request is not a valid {message.__name__} ({e}); every string field must be UTF-8")


def _chunk(update: Update) -> pb.Chunk:
    logprobs = [pb.TokenLogprobs(token_id=token, logprob=chosen,
                                 top=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in top])
                for token, (chosen, top) in zip(update.token_ids, update.logprobs)]
    return pb.Chunk(text=update.text, token_ids=update.token_ids, logprobs=logprobs)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
