"""InferenceService: validates, admits and streams requests through one engine.

Threads. gRPC runs each call on a thread of its pool. Generate validates the request, admits it
against the queue bound, submits it to the engine and then blocks on the request's outbox,
turning each engine Update into a response. When the call ends early (the client cancelled, the
deadline passed) gRPC runs the call's callback, which cancels the request in the engine: its
slot and pages are free within one step. The service never touches engine state directly.

Drain. `begin_drain` refuses new calls with UNAVAILABLE; `wait_idle` waits for in-flight calls;
`abort_in_flight` cancels whatever is left, whose streams then end with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import NoReturn

import grpc

from jaxserve.config import ServerConfig
from jaxserve.engine.engine import Engine, Update
from jaxserve.engine.request import Request
from jaxserve.errors import InputError
from jaxserve.server.metrics import Metrics
from jaxserve.server.validation import Limits, check_length, prompt_ids, sampling_params
from jaxserve.v1 import inference_pb2 as pb
from jaxserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.v1.InferenceService"
RETRY_AFTER_KEY = "retry-after-ms"
_POLL_S = 0.25  # how often a waiting stream checks that its call and the engine are still alive
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """The three RPCs over an engine that is attached once the model is loaded and compiled."""

    def __init__(self, cfg: ServerConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.engine: Engine | None = None
        self.limits: Limits | None = None
        self.info = pb.ModelInfo()
        self._lock = threading.Condition()
        self._in_flight: dict[str, Request | None] = {}  # engine request id -> request (None until submitted)
        self._forced: set[str] = set()  # requests cancelled by the drain rather than by their caller
        self._draining = False

    @property
    def in_flight(self) -> int:
        """Generate calls admitted and not yet finished."""
        with self._lock:
            return len(self._in_flight)

    @property
    def capacity(self) -> int:
        """Calls admitted at once: the engine's slots plus the waiting-queue bound."""
        return self.cfg.engine.max_slots + self.cfg.max_waiting

    def attach(self, engine: Engine, info: pb.ModelInfo) -> None:
        self.info = info
        self.limits = Limits(vocab_size=engine.vocab_size, context_length=engine.context_len,
                             max_sequence_length=engine.cfg.max_seq_len, max_tokens_limit=self.cfg.max_tokens_limit,
                             max_stop_strings=self.cfg.max_stop_strings, max_logprobs=min(20, engine.cfg.max_logprobs))
        self.engine = engine

    # -- drain -------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no Generate call is in flight; False if some still are after `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._in_flight, timeout=timeout)

    def abort_in_flight(self) -> None:
        """Cancels every request still streaming; their calls end with UNAVAILABLE."""
        with self._lock:
            ids = list(self._in_flight)
            self._forced.update(ids)
        for request_id in ids:
            if self.engine is not None:
                self.engine.cancel(request_id)

    # -- RPCs --------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        engine, limits = self._ready(context)
        try:
            ids = prompt_ids(request.WhichOneof("input"), request, engine.tokenizer, limits.vocab_size)
            params = sampling_params(request, limits)
            check_length(len(ids), params, limits)
        except InputError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        engine_id = uuid.uuid4().hex
        reply_id = request.request_id or engine_id
        self._admit(engine_id, context)
        try:
            try:
                submitted = engine.submit(ids, params, engine_id, priority=request.priority)
            except InputError as e:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            with self._lock:
                self._in_flight[engine_id] = submitted
            if not context.add_callback(lambda: engine.cancel(engine_id)):
                engine.cancel(engine_id)  # the call ended already
            self.metrics.prompt_tokens.inc(len(ids))
            yield from self._stream(engine, submitted, reply_id, context)
        finally:
            engine.close_outbox(engine_id)
            with self._lock:
                self._in_flight.pop(engine_id, None)
                self._forced.discard(engine_id)
                self._lock.notify_all()

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        engine, limits = self._ready(context, draining_ok=True)
        try:
            ids = prompt_ids(request.WhichOneof("input"), request, engine.tokenizer, limits.vocab_size)
        except InputError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        self._ready(context, draining_ok=True)
        return self.info

    # -- helpers -----------------------------------------------------------------------------
    def _ready(self, context: grpc.ServicerContext, *, draining_ok: bool = False) -> tuple[Engine, Limits]:
        if self._draining and not draining_ok:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down); retry on another replica")
        if self.engine is None or self.limits is None:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "the model is still loading and compiling; retry shortly")
        if self.engine.fault is not None:
            _abort(context, grpc.StatusCode.UNAVAILABLE,
                   f"the engine stopped after a fault ({type(self.engine.fault).__name__}); this replica must be restarted")
        return self.engine, self.limits

    def _admit(self, engine_id: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            if self._draining:
                _abort(context, grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down); retry on another replica")
            if len(self._in_flight) >= self.capacity:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(self.cfg.retry_after_ms)),))
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the waiting queue is full ({self.cfg.engine.max_slots} running slots and max_waiting="
                       f"{self.cfg.max_waiting} are taken); retry after {self.cfg.retry_after_ms} ms")
            self._in_flight[engine_id] = None

    def _stream(self, engine: Engine, request: Request, reply_id: str,
                context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        box = engine.outbox(request.request_id)
        first = True
        while True:
            try:
                update: Update = box.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return  # cancelled or past its deadline: the callback has cancelled it in the engine
                if engine.fault is not None:
                    _abort(context, grpc.StatusCode.INTERNAL, f"the engine failed: {engine.fault}")
                continue
            if update.error is not None:
                _abort(context, grpc.StatusCode.INTERNAL, update.error)
            if update.finish_reason == "abort":
                if request.request_id in self._forced:
                    _abort(context, grpc.StatusCode.UNAVAILABLE,
                           f"the server shut down after its drain timeout of {self.cfg.drain_timeout_s} s "
                           "before the request finished")
                return
            if update.token_ids:
                if first:
                    self.metrics.first_token(request)
                    first = False
                self.metrics.generation_tokens.inc(len(update.token_ids))
                yield pb.GenerateResponse(request_id=reply_id, chunk=_chunk(update))
            if update.finish_reason is not None:
                self.metrics.finished(request)
                usage = pb.Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.output_ids),
                                 cached_tokens=request.cached_tokens)
                yield pb.GenerateResponse(request_id=reply_id, completion=pb.Completion(
                    finish_reason=_FINISH_REASONS[update.finish_reason], usage=usage))
                return


def _chunk(update: Update) -> pb.Chunk:
    logprobs = [pb.TokenLogprobs(token_id=token, logprob=chosen,
                                 top=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in top])
                for token, (chosen, top) in zip(update.token_ids, update.logprobs)]
    return pb.Chunk(text=update.text, token_ids=update.token_ids, logprobs=logprobs)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
