"""The gRPC server: InferenceService, health and reflection on one port, metrics on another.

Life cycle. `start` binds the ports with health NOT_SERVING, so probes answer while weights load
and buckets compile; `attach` hands over a started engine and turns health SERVING; `drain`
(on SIGTERM) turns health NOT_SERVING for good, refuses new calls with UNAVAILABLE and gives
in-flight calls up to the drain timeout; `stop` closes the ports. An engine fault turns health
NOT_SERVING and is logged; the failed calls end with INTERNAL.

The gRPC server is grpc.aio's, on an event loop of its own thread (see jaxserve.server.service); these methods
are called from other threads and hand their work to that loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import ServerConfig
from jaxserve.engine.engine import Engine
from jaxserve.errors import JaxserveError
from jaxserve.server.auth import BearerTokenInterceptor, load_token
from jaxserve.server.frontend import Frontend
from jaxserve.server.metrics import Metrics
from jaxserve.server.service import SERVICE_NAME, InferenceServicer
from jaxserve.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

HEALTH_NAMES = ("", SERVICE_NAME)
T = TypeVar("T")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise JaxserveError(f"cannot read {what}={path!r}: {e.strerror}") from e


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS from the config's PEM files; with tls_client_ca, clients must present a certificate (mTLS)."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    pair = (_read(cfg.tls_key, "tls_key"), _read(cfg.tls_cert, "tls_cert"))
    ca = _read(cfg.tls_client_ca, "tls_client_ca") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class Server:
    """One gRPC server and its metrics endpoint over (eventually) one engine."""

    def __init__(self, cfg: ServerConfig, *, model_name: str = "jaxserve",
                 compilations: Callable[[], int] | None = None) -> None:
        self.cfg = cfg
        self.metrics = Metrics(model_name, **({"compilations": compilations} if compilations else {}))
        self.front = Frontend(cfg)
        self.service = InferenceServicer(cfg, self.metrics, self.front)
        self._token = load_token(cfg.auth_token, cfg.auth_token_file)
        self._metrics_token = load_token(cfg.metrics_auth_token, cfg.metrics_auth_token_file)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-grpc", daemon=True)
        self._thread.start()
        self.health = health_aio.HealthServicer()
        self._grpc = self._call(self._build())
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.engine: Engine | None = None
        self._serving = False  # health is SERVING (HTTP's /health reads it)
        self._http: Any = None
        self._http_thread: threading.Thread | None = None

    async def _build(self) -> grpc.aio.Server:
        server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(self._token)] if self._token else [],
            options=[("grpc.max_receive_message_length", self.cfg.max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        server.add_generic_rpc_handlers((self.service.handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["InferenceService"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME), server)
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        return server

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs `coroutine` on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _set_health(self, status: Any) -> None:
        for name in HEALTH_NAMES:
            self._call(self.health.set(name, status))

    def start(self) -> None:
        """Binds and starts serving health (NOT_SERVING) and metrics; Generate answers UNAVAILABLE until `attach`."""
        address = f"{self.cfg.host}:{self.cfg.port}"
        creds = server_credentials(self.cfg)
        try:
            port = self._grpc.add_secure_port(address, creds) if creds else self._grpc.add_insecure_port(address)
        except RuntimeError as e:
            raise JaxserveError(f"cannot listen on {address}: {e}; is the port taken?") from e
        if not port:
            raise JaxserveError(f"cannot listen on {address}; is the port taken?")
        self.port = port
        self._call(self._grpc.start())
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port, self._metrics_token)
        if self.cfg.http_port:
            self._start_http()
        log.info("gRPC on %s:%d (%s), HTTP on %s, metrics on %s", self.cfg.host, port, "TLS" if creds else "plaintext",
                 f"{self.cfg.host}:{self.http_port}" if self.http_port else "off",
                 f"{self.cfg.metrics_host}:{self.metrics_port}" if self.metrics_port is not None else "off")

    def _start_http(self) -> None:
        """The OpenAI-compatible API (jaxserve.http) on uvicorn, on a thread and event loop of its own."""
        import ssl

        import uvicorn

        from jaxserve.http.app import build_app

        cfg = self.cfg
        app = build_app(self.front, cfg, self.metrics, serving=lambda: self._serving, token=self._token)
        tls: dict[str, Any] = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key} if cfg.tls_cert else {}
        if cfg.tls_client_ca:
            tls.update(ssl_ca_certs=cfg.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self._http = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_level="warning",
                                                   lifespan="off", access_log=False, **tls))
        self._http_thread = threading.Thread(target=self._http.run, name="jaxserve-http", daemon=True)
        self._http_thread.start()
        deadline = time.monotonic() + 30
        while not self._http.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise JaxserveError(f"cannot listen on {cfg.host}:{cfg.http_port} for HTTP; is the port taken? "
                                    "(http_port: 0 turns HTTP off)")
            time.sleep(0.01)
        self.http_port = int(self._http.servers[0].sockets[0].getsockname()[1])

    def attach(self, engine: Engine, info: pb.ModelInfo) -> None:
        """Serves `engine` (already started) from now on and turns health SERVING."""
        self.engine = engine
        engine.on_fault.append(self._on_fault)
        self.front.attach(engine)
        self.service.info = info
        self.metrics.watch(engine)
        if engine.fault is None:
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self._serving = True

    def _on_fault(self, error: BaseException) -> None:
        log.error("engine fault, health is NOT_SERVING from now on: %s: %s", type(error).__name__, error)
        self._serving = False
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def drain(self, timeout_s: float | None = None) -> bool:
        """NOT_SERVING, refuse new calls, wait for in-flight ones; True if all finished within the timeout."""
        timeout_s = self.cfg.drain_timeout_s if timeout_s is None else timeout_s
        self._serving = False
        self._call(self.health.enter_graceful_shutdown())
        self.front.begin_drain()
        start = time.perf_counter()
        finished = self.front.wait_idle(timeout_s)
        if not finished:
            log.warning("drain timeout of %.1f s passed; cancelling the calls still in flight", timeout_s)
            self.front.abort_in_flight()
            self.front.wait_idle(5.0)
        log.info("drained in %.1f s", time.perf_counter() - start)
        return finished

    def stop(self, grace_s: float = 1.0) -> None:
        if self._loop.is_closed():
            return
        if self._http is not None:
            self._http.should_exit = True
            if self._http_thread is not None:
                self._http_thread.join(timeout=10)
        self._call(self._grpc.stop(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self.metrics.stop()
        self.front.close()


def model_info(model: Any, engine: Engine, cfg: ServerConfig, *, dtype: str) -> pb.ModelInfo:
    """GetModelInfo's answer for a LoadedModel served by `engine`."""
    tok = model.tokenizer
    return pb.ModelInfo(
        source=cfg.model_name, architecture=model.config.architecture, vocab_size=model.config.vocab_size,
        context_length=model.config.max_position_embeddings, max_sequence_length=engine.cfg.max_seq_len,
        max_tokens_limit=cfg.max_tokens_limit, max_stop_strings=cfg.max_stop_strings,
        max_logprobs=min(20, engine.cfg.max_logprobs), eos_token_ids=list(tok.eos_token_ids), dtype=dtype,
        has_chat_template=bool(tok.chat_template), max_slots=engine.cfg.max_slots)


def serve(cfg: ServerConfig, load: Callable[[], tuple[Engine, pb.ModelInfo]], *,
          compilations: Callable[[], int] | None = None) -> int:
    """Runs a server until SIGTERM or SIGINT, then drains it; returns the exit code (0).

    The ports open first, with health NOT_SERVING; `load` then loads the weights and compiles every
    bucket (the caller owns the device side) and returns the engine, not yet started. It runs on a
    thread of its own, so that a signal reaches the main thread while XLA compiles: there is nothing to
    drain yet, so the process exits at once, with 128 + the signal's number (as a shell reports a process
    the signal killed).
    """
    stop = threading.Event()
    loading = threading.Event()
    loading.set()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if loading.is_set():
            log.warning("%s received while loading: exiting without serving", name)
            os._exit(128 + signum)  # the compile threads cannot be interrupted; nothing is lost with them
        log.warning("%s received: draining", name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = Server(cfg, model_name=cfg.model_name, compilations=compilations)
    server.start()
    log.info("listening on %s:%d; loading %s", cfg.host, server.port, cfg.model or "the embedded model")
    start = time.perf_counter()
    result: list[tuple[Engine, pb.ModelInfo]] = []
    failure: list[BaseException] = []

    def run_load() -> None:
        try:
            result.append(load())
        except BaseException as e:  # raised again on the main thread
            failure.append(e)

    loader = threading.Thread(target=run_load, name="jaxserve-load", daemon=True)
    loader.start()
    while loader.is_alive():
        loader.join(0.5)
    if failure:
        server.stop(0)
        raise failure[0]
    loading.clear()  # a signal from here on drains
    engine, info = result[0]
    engine.start()
    server.attach(engine, info)
    log.info("serving %s (%s) on %s:%d after %.1f s; metrics on %s", info.source, info.dtype, cfg.host, server.port,
             time.perf_counter() - start,
             f"{cfg.metrics_host}:{server.metrics_port}" if server.metrics_port is not None else "off")
    while not stop.wait(1.0):
        pass
    server.drain()
    server.stop()
    engine.stop()
    log.info("stopped")
    return 0
