"""Bearer-token auth for InferenceService calls; health and reflection stay open."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from jaxserve.errors import JaxserveError

PROTECTED_PREFIX = "/jaxserve.v1.InferenceService/"


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The configured token: given inline, or read (and stripped) from a file such as a mounted secret."""
    if token_file is None:
        return token
    try:
        with open(token_file) as f:
            token = f.read().strip()
    except OSError as e:
        raise JaxserveError(f"cannot read auth_token_file={token_file!r}: {e.strerror}") from e
    if not token:
        raise JaxserveError(f"auth_token_file={token_file!r} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses InferenceService calls without `authorization: Bearer <token>` (UNAUTHENTICATED).

    The comparison is constant-time, so response timing does not reveal how much of a guess was right.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):  # type: ignore[attr-defined]
            return handler
        sent = dict(details.invocation_metadata).get("authorization", "")  # type: ignore[attr-defined]
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return handler
        message = "missing authorization metadata" if not sent else "wrong bearer token"
        return _refusal(handler, f"{message}; send the metadata 'authorization: Bearer <token>'")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
