"""InferenceService: the gRPC surface over the serving front (jaxserve.server.frontend).

Concurrency. The service runs on one asyncio event loop (grpc.aio): a call is a coroutine, never a thread, so a
client that stops reading its stream holds no thread and no admission place (the front counts only what the engine
holds). A stream that cannot write for `stream_idle_timeout_s` is cancelled. A cancelled call or an expired
deadline cancels the call's coroutine at once, which cancels its request in the engine: the slot and pages are
free within one engine step.

Drain. The front's `begin_drain` (any thread) refuses new calls with UNAVAILABLE; `wait_idle` waits for in-flight
calls; `abort_in_flight` cancels whatever is left, whose streams then end with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from jaxserve.config import SamplingParams, ServerConfig
from jaxserve.engine import validation
from jaxserve.engine.engine import Update
from jaxserve.engine.validation import InvalidArgument, Limits
from jaxserve.errors import InputError
from jaxserve.server.frontend import Ended, Frontend, Refused
from jaxserve.server.metrics import Metrics
from jaxserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.v1.InferenceService"
RETRY_AFTER_KEY = "retry-after-ms"
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_ENDED = {"drained": grpc.StatusCode.UNAVAILABLE, "behind": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "deadline": grpc.StatusCode.DEADLINE_EXCEEDED, "error": grpc.StatusCode.INTERNAL}
M = TypeVar("M")
_FIELDS_BYTES = 16384  # a request's fields beside its prompt: ids, stop strings, sampling


class InferenceServicer:
    """The three RPCs over the front's engine, attached once the model is loaded and compiled."""

    def __init__(self, cfg: ServerConfig, metrics: Metrics, front: Frontend) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.front = front
        self.info = pb.ModelInfo()

    @property
    def in_flight(self) -> int:
        return self.front.in_flight

    @property
    def held(self) -> int:
        return self.front.held

    @property
    def capacity(self) -> int:
        return self.front.capacity

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

    # -- RPCs --------------------------------------------------------------------------------
    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await self._check_size(raw, context)
        request = await _parse(raw, pb.GenerateRequest, context)
        try:
            _, limits = self.front.ready()
            caller_id = validation.request_id(request.request_id)
            params = _sampling(request, limits)
            constraint = _constraint(request.sampling)
            if constraint is not None:
                params = dataclasses.replace(params, grammar=await self.front.constraint(*constraint))
            ids = await self._prompt_ids(request)
            validation.fits(len(ids), params, limits, "sampling.max_tokens")
            reply_id, seen = "", set()
            stream = self.front.generate_many([(ids, child) for child in params.children()], priority=request.priority,
                                              timeout=context.time_remaining())
            async with contextlib.aclosing(stream):  # closed at once when the call ends early: frees its slots
                async for index, submitted, update in stream:
                    if not reply_id:  # (submitted: its prompt tokens count from here, once for its n samples)
                        reply_id = caller_id or submitted.request_id
                        self.metrics.prompt_tokens.inc(len(ids))
                    self.metrics.count(submitted, update, first=index not in seen)
                    if update.token_ids:
                        seen.add(index)
                        await self._write(context, pb.GenerateResponse(request_id=reply_id, chunk=_chunk(update, index, ids)),
                                          submitted.request_id)
                    if update.finish_reason is not None:
                        usage = pb.Usage(prompt_tokens=len(submitted.prompt_ids),
                                         completion_tokens=len(submitted.output_ids), cached_tokens=submitted.cached_tokens)
                        await self._write(context, pb.GenerateResponse(request_id=reply_id, completion=pb.Completion(
                            finish_reason=_FINISH_REASONS[update.finish_reason], usage=usage, index=index)),
                            submitted.request_id)
        except InputError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Refused as e:
            if e.kind == "full":
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(self.cfg.retry_after_ms)),))
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED if e.kind == "full" else grpc.StatusCode.UNAVAILABLE,
                         str(e))
        except Ended as e:
            await _abort(context, _ENDED[e.kind], str(e))

    async def Tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._check_size(raw, context)
        request = await _parse(raw, pb.TokenizeRequest, context)
        try:
            ids = await self._prompt_ids(request)
        except InputError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Refused as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await _parse(raw, pb.GetModelInfoRequest, context)
        try:
            self.front.ready(draining_ok=True)
        except Refused as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return self.info

    # -- helpers -----------------------------------------------------------------------------
    async def _check_size(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        """Refuses, unparsed, a request too large to hold a prompt the server takes: parsing megabytes (UTF-8
        checks included) on the event loop would hold every other call up."""
        limits = self.front.limits
        if limits is None:
            return
        # the largest prompt (text, chat contents, or token ids at up to 5 bytes each) and room for the rest
        most = max(limits.max_prompt_bytes, 5 * limits.room) + _FIELDS_BYTES + 32 * limits.max_messages
        if len(raw) > most:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"the request is {len(raw)} bytes, more than any prompt this server takes needs ({most}; "
                         f"max_prompt_bytes={limits.max_prompt_bytes})")

    async def _prompt_ids(self, request: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("the request has no input: set one of prompt, token_ids or messages")
        if kind == "token_ids":
            return self.front.token_ids(list(request.token_ids.ids), "token_ids.ids")  # type: ignore[union-attr]
        if kind == "prompt":
            return await self.front.encode_text(request.prompt)
        return await self.front.encode_chat([{"role": m.role, "content": m.content} for m in request.messages.messages],
                                            "messages.messages")

    async def _write(self, context: grpc.aio.ServicerContext, response: pb.GenerateResponse, engine_id: str) -> None:
        try:
            await asyncio.wait_for(context.write(response), self.cfg.stream_idle_timeout_s)
        except TimeoutError:
            log.warning("a stream was not read for stream_idle_timeout_s=%s s: cancelled", self.cfg.stream_idle_timeout_s)
            # The status cannot pass the unsent output ahead of it (HTTP/2 flow control holds both): the request and
            # the call's place are freed now, and the client sees the status once it reads what is queued.
            self.front.end(engine_id)
            await _abort(context, grpc.StatusCode.CANCELLED,
                         f"the stream was not read for stream_idle_timeout_s={self.cfg.stream_idle_timeout_s} s")


def _sampling(request: pb.GenerateRequest, limits: Limits) -> SamplingParams:
    s = request.sampling
    names = {key: f"sampling.{key}" for key in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                                 "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty",
                                                 "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                                                 "min_tokens", "n", "prompt_logprobs", "speculate")}
    return validation.sampling(limits, max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
                               temperature=s.temperature, top_k=s.top_k,
                               top_p=s.top_p if s.HasField("top_p") else 1.0, seed=s.seed, stop=list(s.stop),
                               stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs,
                               presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                               repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
                               min_p=s.min_p, logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
                               n=s.n if s.HasField("n") else 1,
                               prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                               speculate=s.speculate if s.HasField("speculate") else None, names=names)


def _constraint(s: pb.SamplingParams) -> validation.Constraint | None:
    """The request's structured-output constraint (SamplingParams' oneof `constraint`) as validation.constraint
    takes it, or None."""
    kind = s.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not s.json_object):
        return None
    value = {"json_schema": s.json_schema, "json_object": None, "regex": s.regex, "choice": list(s.choice.choices),
             "grammar": s.grammar}[kind]
    return kind, value, f"sampling.{kind}"


async def _parse(raw: bytes, message: type[M], context: grpc.aio.ServicerContext) -> M:
    try:
        return message.FromString(raw)  # type: ignore[attr-defined, no-any-return]
    except DecodeError as e:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"the request is not a valid {message.__name__} ({e}); every string field must be UTF-8")


def _chunk(update: Update, index: int, prompt_ids: list[int]) -> pb.Chunk:
    def entry(token: int, chosen: float, top: list[tuple[int, float]]) -> pb.TokenLogprobs:
        return pb.TokenLogprobs(token_id=token, logprob=chosen, top=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in top])

    logprobs = [entry(token, chosen, top) for token, (chosen, top) in zip(update.token_ids, update.logprobs)]
    prompt = [entry(token, *e) for token, e in zip(prompt_ids[1:], (update.prompt_logprobs or [None])[1:]) if e]
    return pb.Chunk(text=update.text, token_ids=update.token_ids, logprobs=logprobs, index=index, prompt_logprobs=prompt)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
