"""Python client for `jaxserve.v1.InferenceService`: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as client:
        for response in client.generate(prompt="The capital of France is", max_tokens=16):
            if response.HasField("chunk"):
                print(response.chunk.text, end="", flush=True)
        print(client.complete(prompt="2 + 2 =", max_tokens=4).text)

Failures arrive as `grpc.RpcError` with the server's status code and message.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.v1 import inference_pb2 as pb
from jaxserve.v1 import inference_pb2_grpc as pb_grpc

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True, kw_only=True)
class TLS:
    """PEM bytes: the CA that signed the server's certificate, and for mutual TLS this client's own pair."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None  # overrides the name checked against the server certificate

    @classmethod
    def from_files(cls, ca: str | None = None, key: str | None = None, cert: str | None = None,
                   server_name: str | None = None) -> TLS:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return cls(root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert),
                   server_name=server_name)


@dataclass
class Completion:
    """A whole generation, gathered from its stream (one sample's: `index`; a stream of n samples makes n)."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    index: int = 0
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)

    def add(self, response: pb.GenerateResponse) -> None:
        self.request_id = response.request_id
        if response.HasField("chunk"):
            self.text += response.chunk.text
            self.token_ids.extend(response.chunk.token_ids)
            self.logprobs.extend(response.chunk.logprobs)
            self.prompt_logprobs.extend(response.chunk.prompt_logprobs)
            self.index = response.chunk.index
        elif response.HasField("completion"):
            done = response.completion
            self.finish_reason = FINISH_REASONS.get(done.finish_reason, "unspecified")
            self.prompt_tokens = done.usage.prompt_tokens
            self.completion_tokens = done.usage.completion_tokens
            self.cached_tokens = done.usage.cached_tokens
            self.index = done.index


def gather(responses: Iterable[pb.GenerateResponse]) -> list[Completion]:
    """Each sample's Completion from a stream, in sample order."""
    samples: dict[int, Completion] = {}
    for response in responses:
        kind = response.chunk if response.HasField("chunk") else response.completion
        samples.setdefault(kind.index, Completion()).add(response)
    return [samples[i] for i in sorted(samples)]


def generate_request(*, prompt: str | None = None, token_ids: Sequence[int] | None = None,
                     messages: Sequence[dict[str, str]] | None = None, request_id: str = "", priority: int = 0,
                     max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float | None = None,
                     seed: int = 0, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                     logprobs: int = 0, **sampling: Any) -> pb.GenerateRequest:
    """Builds a GenerateRequest; exactly one of prompt, token_ids and messages must be given. `sampling`: more
    SamplingParams fields by name (presence_penalty, logit_bias, n, prompt_logprobs, ...)."""
    given = [name for name, value in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of prompt, token_ids, messages; got {given or 'none'}")
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                 logprobs=logprobs, **sampling)
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling, priority=priority)
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.token_ids.SetInParent()  # selects the input even when the list is empty
        request.token_ids.ids.extend(token_ids)
    else:
        request.messages.SetInParent()
        request.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ())
    return request


def _tokenize_request(prompt: str | None, messages: Sequence[dict[str, str]] | None) -> pb.TokenizeRequest:
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt and messages")
    if prompt is not None:
        return pb.TokenizeRequest(prompt=prompt)
    return pb.TokenizeRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]))


def _channel_args(tls: TLS | None, options: Sequence[tuple[str, Any]]) -> tuple[grpc.ChannelCredentials | None, list]:
    opts = list(options)
    if tls is None:
        return None, opts
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = grpc.ssl_channel_credentials(root_certificates=tls.root_certificates, private_key=tls.private_key,
                                         certificate_chain=tls.certificate_chain)
    return creds, opts


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Client:
    """Blocking client. `timeout` (seconds) sets each call's deadline."""

    def __init__(self, address: str, *, token: str | None = None, tls: TLS | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        creds, opts = _channel_args(tls, options)
        self.channel = grpc.secure_channel(address, creds, opts) if creds else grpc.insecure_channel(address, opts)
        self._stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = _metadata(token)

    def generate(self, *, timeout: float | None = None, **kwargs: Any) -> Iterator[pb.GenerateResponse]:
        """Streams responses (chunks, then one completion); `kwargs` as `generate_request`.

        The returned iterator is also the call: `.cancel()` on it cancels the request on the server.
        """
        return self._stub.Generate(generate_request(**kwargs), timeout=timeout, metadata=self._metadata)

    def complete(self, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        """Runs a generation to its end and returns it gathered."""
        result = Completion()
        for response in self.generate(timeout=timeout, **kwargs):
            result.add(response)
        return result

    def tokenize(self, *, prompt: str | None = None, messages: Sequence[dict[str, str]] | None = None,
                 timeout: float | None = None) -> list[int]:
        response = self._stub.Tokenize(_tokenize_request(prompt, messages), timeout=timeout, metadata=self._metadata)
        return list(response.token_ids)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """"SERVING", "NOT_SERVING", ... for `service` ("" is the whole server)."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def wait_until_serving(self, timeout: float, *, alive: Callable[[], bool] = lambda: True) -> float:
        """Polls health until SERVING and returns the seconds waited; raises TimeoutError after `timeout`, or
        RuntimeError as soon as `alive()` is false (say, the server's process has exited)."""
        start = time.monotonic()
        while True:
            if not alive():
                raise RuntimeError(f"the server stopped before it was SERVING ({time.monotonic() - start:.1f} s)")
            try:
                if self.health(timeout=2) == "SERVING":
                    return time.monotonic() - start
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"the server was not SERVING after {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncClient:
    """The same calls for asyncio; create it inside a running event loop."""

    def __init__(self, address: str, *, token: str | None = None, tls: TLS | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        creds, opts = _channel_args(tls, options)
        self.channel = (grpc.aio.secure_channel(address, creds, opts) if creds
                        else grpc.aio.insecure_channel(address, opts))
        self._stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = _metadata(token)

    async def generate(self, *, timeout: float | None = None, **kwargs: Any) -> AsyncIterator[pb.GenerateResponse]:
        """Streams responses; breaking out of the loop (or cancelling the task) cancels the request."""
        call = self._stub.Generate(generate_request(**kwargs), timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def complete(self, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        result = Completion()
        async for response in self.generate(timeout=timeout, **kwargs):
            result.add(response)
        return result

    async def tokenize(self, *, prompt: str | None = None, messages: Sequence[dict[str, str]] | None = None,
                       timeout: float | None = None) -> list[int]:
        response = await self._stub.Tokenize(_tokenize_request(prompt, messages), timeout=timeout,
                                             metadata=self._metadata)
        return list(response.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
