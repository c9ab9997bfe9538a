"""OpenAI-compatible HTTP API (FastAPI) over the serving front that gRPC uses: both kinds of request batch together.

Endpoints: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with `stream`), GET /v1/models,
GET /health (200 only while SERVING), POST /tokenize and /detokenize (vLLM's shapes), GET /metrics (the same
registry as the metrics port). Errors use OpenAI's body, {"error": {"message", "type", "param", "code"}}, and name
the field and value. With the server's auth token set, /v1/* and /tokenize, /detokenize need
`Authorization: Bearer <token>`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxserve.config import ServerConfig
from jaxserve.engine import validation
from jaxserve.engine.validation import InvalidArgument, Limits
from jaxserve.errors import InputError
from jaxserve.http.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxserve.openai_format import Formatter
from jaxserve.server.frontend import Ended, Frontend, Refused
from jaxserve.server.metrics import Metrics

log = logging.getLogger(__name__)

_ENDED_STATUS = {"drained": 503, "behind": 429, "deadline": 408, "error": 500}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status,
                        headers=headers)


def build_app(front: Frontend, cfg: ServerConfig, metrics: Metrics, *, serving: Callable[[], bool],
              token: str | None = None) -> FastAPI:
    """The HTTP API over `front`; `serving()` says whether health is SERVING."""
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None)
    expected = f"Bearer {token}".encode() if token else None
    name = cfg.model_name

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        value = first.get("input")
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
        return error_response(400, f"{where}={shown}: {first['msg']}" if where else first["msg"], param=where or None)

    @app.exception_handler(HTTPError)
    async def http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.kind, exc.param)

    @app.middleware("http")
    async def auth(request: Request, call_next: Callable[[Request], Any]) -> Response:
        size = int(request.headers.get("content-length") or 0)
        if size > cfg.max_message_bytes:
            return error_response(413, f"the body is {size} bytes; at most {cfg.max_message_bytes} (max_message_bytes)")
        guarded = request.url.path.startswith("/v1/") or request.url.path in ("/tokenize", "/detokenize")
        if expected is not None and guarded:
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, expected):
                return error_response(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>'",
                                      "authentication_error")
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if serving() else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        limits = _ready(front, draining_ok=True)[1]
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "jaxserve",
                                            "max_model_len": limits.room}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, name)
        limits = _ready(front, draining_ok=True)[1]
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "send exactly one of prompt and messages")
        ids = await _guard(front.encode_text(body.prompt) if body.prompt is not None else
                           front.encode_chat([m.as_dict() for m in body.messages or []]))
        return {"count": len(ids), "max_model_len": limits.room, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, name)
        try:
            ids = front.token_ids(body.tokens, "tokens")
        except InputError as e:
            raise HTTPError(400, str(e)) from None
        return {"prompt": await front.decode(ids)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response | dict[str, Any]:
        _check_common(body, name)
        limits = _ready(front)[1]
        prompts = await _guard(_completion_prompts(front, body.prompt))
        if body.logprobs is not None and not 0 <= body.logprobs <= limits.max_logprobs:
            raise HTTPError(400, f"logprobs={body.logprobs} must be between 0 and {limits.max_logprobs}", param="logprobs")
        if body.tools or body.tool_choice is not None:
            raise HTTPError(400, "tools and tool_choice are for /v1/chat/completions", param="tools")
        grammar = await _guard(_grammar(front, body, None))
        return await _run(front, metrics, body, prompts, limits, name, chat=False, logprobs=body.logprobs or 0,
                          grammar=grammar)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> Response | dict[str, Any]:
        _check_common(body, name)
        limits = _ready(front)[1]
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise HTTPError(400, f"max_tokens={body.max_tokens} and max_completion_tokens={body.max_completion_tokens} "
                                 "differ; send one", param="max_completion_tokens")
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = body.top_logprobs or 0
        if not 0 <= top <= limits.max_logprobs:
            raise HTTPError(400, f"top_logprobs={top} must be between 0 and {limits.max_logprobs}", param="top_logprobs")
        try:
            tools, choice = validation.tools(body.tools, body.tool_choice, limits, body.parallel_tool_calls)
            tool_format, tool_constraint = validation.tool_calling(tools, choice, body.parallel_tool_calls,
                                                                   front.engine.tokenizer.chat_template
                                                                   if front.engine is not None else None)
        except InputError as e:
            raise HTTPError(400, str(e), param="tools") from None
        prompts = [await _guard(front.encode_chat([m.as_dict() for m in body.messages], tools=tools or None))]
        grammar = await _guard(_grammar(front, body, tool_constraint))
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        # (logprobs: true with no top_logprobs still reports each chosen token's log-probability)
        return await _run(front, metrics, body, prompts, limits, name, chat=True,
                          logprobs=max(top, 1) if body.logprobs else 0, top=top, grammar=grammar,
                          tool_format=tool_format)

    return app


def _ready(front: Frontend, *, draining_ok: bool = False) -> tuple[Any, Limits]:
    try:
        return front.ready(draining_ok=draining_ok)
    except Refused as e:
        raise HTTPError(503, str(e), "service_unavailable") from None


def _check_model(model: str | None, name: str) -> None:
    if model is not None and model != name:
        raise HTTPError(404, f"model={model!r} is not served here; this server serves {name!r}", "not_found_error",
                        "model")


def _check_common(body: Any, name: str) -> None:
    _check_model(body.model, name)
    if body.model_extra:
        log.warning("ignored unknown request fields: %s", ", ".join(sorted(body.model_extra)))
    unsupported = body.unsupported()
    if unsupported:
        raise HTTPError(400, f"{unsupported[0]}={getattr(body, unsupported[0])!r} is not supported by jaxserve yet; "
                             "leave it out", param=unsupported[0])


async def _guard(work: Any) -> Any:
    try:
        return await work
    except InputError as e:
        raise HTTPError(400, str(e)) from None
    except Refused as e:
        raise HTTPError(503, str(e), "service_unavailable") from None


async def _completion_prompts(front: Frontend, prompt: Any) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [await front.encode_text(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [front.token_ids(prompt, "prompt")]
    if not prompt:
        raise InvalidArgument("prompt=[] must hold at least one prompt")
    out = []
    for i, p in enumerate(prompt):
        out.append(await front.encode_text(p, f"prompt[{i}]") if isinstance(p, str) else front.token_ids(p, f"prompt[{i}]"))
    return out


def _children(body: Any, prompts: list[list[int]], limits: Limits, chat: bool, logprobs: int,
              prompt_only: bool) -> list[tuple[int, list[int], Any]]:
    """(choice index, prompt ids, SamplingParams) of every choice: n of them a prompt, sample i seeded seed + i
    (a random seed when none is given). `prompt_only` (echo with max_tokens 0) still runs one token: the prefill
    computes the prompt's log-probabilities."""
    echo = getattr(body, "echo", False)
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (logprobs if echo and logprobs
                                                                                     else None)
    children = []
    for p, ids in enumerate(prompts):
        # OpenAI's defaults: 16 tokens for a completion, what the context leaves for a chat
        room = min(limits.room - len(ids), limits.max_tokens_limit)
        max_tokens = body.max_tokens if body.max_tokens is not None else (max(1, room) if chat else 16)
        try:
            params = validation.sampling(
                limits, max_tokens=1 if prompt_only else max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature, top_k=body.top_k or 0,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed if body.seed is not None else secrets.randbits(32), stop=body.stop or [],
                stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_p=body.min_p, logit_bias=body.logit_bias,
                min_tokens=body.min_tokens, n=body.n, prompt_logprobs=prompt_logprobs, speculate=body.speculate,
                names={"max_tokens": "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"})
            validation.fits(len(ids), params, limits)
        except InputError as e:
            raise HTTPError(400, str(e)) from None
        children += [(p * body.n + c, ids, child) for c, child in enumerate(params.children())]
    return children


async def _grammar(front: Frontend, body: Any, tool_constraint: validation.Constraint | None) -> str | None:
    """The grammar of the one constraint the request asks for (validation.requested_constraint), or None."""
    requested = validation.requested_constraint(body.response_format, body.structured_outputs, tool_constraint)
    return None if requested is None else await front.constraint(*requested)


async def _run(front: Frontend, metrics: Metrics, body: Any, prompts: list[list[int]], limits: Limits, name: str, *,
               chat: bool, logprobs: int, top: int = 0, grammar: str | None = None,
               tool_format: str | None = None) -> Response | dict[str, Any]:
    echo = getattr(body, "echo", False)
    prompt_only = echo and body.max_tokens == 0
    children = [(i, ids, dataclasses.replace(params, grammar=grammar))
                for i, ids, params in _children(body, prompts, limits, chat, logprobs, prompt_only)]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    tok = front.engine.tokenizer if front.engine is not None else None
    for _, ids, _ in children:
        metrics.prompt_tokens.inc(len(ids))

    async def updates() -> AsyncGenerator[tuple[int, Any, Any], None]:
        """Every choice's updates as they come, counted in the metrics."""
        seen: set[int] = set()
        async with contextlib.aclosing(front.generate_many([(ids, params) for _, ids, params in children])) as stream:
            async for index, request, update in stream:
                metrics.count(request, update, first=index not in seen)
                if update.token_ids:
                    seen.add(index)
                yield index, request, update

    fmt = Formatter(tok, chat, top, logprobs, rid, created, name, len(children), body.n,
                     [ids for _, ids, _ in children], echo=echo, prompt_only=prompt_only,
                     prompt_logprobs=children[0][2].prompt_logprobs if body.prompt_logprobs is not None else None,
                     tool_format=tool_format)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(updates(), fmt, usage), media_type="text/event-stream")
    try:
        async with contextlib.aclosing(updates()) as stream:
            async for index, request, update in stream:
                fmt.add(index, request, update)
    except Refused as e:
        retry = {"Retry-After": str(max(1, -(-front.cfg.retry_after_ms // 1000))),
                 "retry-after-ms": str(front.cfg.retry_after_ms)}
        return error_response(429 if e.kind == "full" else 503, str(e),
                              "rate_limit_error" if e.kind == "full" else "service_unavailable",
                              headers=retry if e.kind == "full" else None)
    except Ended as e:
        return error_response(_ENDED_STATUS[e.kind], str(e), "server_error")
    except InputError as e:
        return error_response(400, str(e))
    return fmt.response()


async def _sse(updates: AsyncGenerator[tuple[int, Any, Any], None], fmt: Formatter, usage: bool) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(updates) as stream:
            async for index, request, update in stream:
                fmt.add(index, request, update)
                yield f"data: {json.dumps(fmt.chunk(index, update))}\n\n"
        if usage:
            yield f"data: {json.dumps(fmt.usage_chunk())}\n\n"
    except (Refused, Ended, InputError) as e:
        status = 400 if isinstance(e, InputError) else 429 if isinstance(e, Refused) and e.kind == "full" else \
            _ENDED_STATUS.get(getattr(e, "kind", ""), 503)
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'param': None, 'code': status}})}\n\n"
    yield "data: [DONE]\n\n"
