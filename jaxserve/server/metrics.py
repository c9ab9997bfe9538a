"""Prometheus metrics, named as vLLM's with the prefix `jaxserve:`, served on their own HTTP port.

Latency histograms are observed by the server as requests stream; the gauges and the engine's
counters (running, waiting, KV usage, preemptions, compilations) are read from the engine when
Prometheus scrapes. Each Metrics owns its registry: nothing global.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request

PREFIX = "jaxserve:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads the engine's queues, page pool and counters at scrape time."""

    def __init__(self, model_name: str, compilations: Callable[[], int]) -> None:
        self.model_name = model_name
        self.compilations = compilations
        self.engine: Engine | None = None

    def collect(self) -> Iterator[Metric]:
        labels = [self.model_name]
        running = GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in engine slots.", labels=["model_name"])
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting for a slot.", labels=["model_name"])
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV pages in use (1 is full).",
                                  labels=["model_name"])
        preemptions = CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted for KV pages.",
                                          labels=["model_name"])
        compilations = CounterMetricFamily(PREFIX + "compilations", "XLA compilations in this process.",
                                           labels=["model_name"])
        spec = [CounterMetricFamily(PREFIX + f"spec_decode_{name}", text, labels=["model_name"]) for name, text in (
            ("num_drafts", "Speculative verify rows."), ("num_draft_tokens", "Speculative tokens proposed."),
            ("num_accepted_tokens", "Speculative tokens accepted."))]
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Speculative tokens accepted, by their position in the draft.",
                                           labels=["model_name", "position"])
        engine = self.engine
        if engine is not None:
            scheduler = engine.scheduler
            pages = scheduler.pages
            running.add_metric(labels, len(scheduler.running))
            waiting.add_metric(labels, len(scheduler.waiting))
            usage.add_metric(labels, (pages.num_pages - pages.num_available) / pages.num_pages)
            preemptions.add_metric(labels, scheduler.num_preemptions)
            stats = engine.spec
            for family, value in zip(spec, (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)):
                family.add_metric(labels, value)
            for position, count in enumerate(stats.accepted_per_position):
                per_position.add_metric([self.model_name, str(position)], count)
        compilations.add_metric(labels, self.compilations())
        yield from (running, waiting, usage, preemptions, compilations, *spec, per_position)


class Metrics:
    """The server's metrics in their own registry."""

    def __init__(self, model_name: str, *, compilations: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS,
                              **kw).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token of finished requests.",
                             buckets=_REQUEST_BUCKETS, **kw).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival until the request first took a slot.",
                                    buckets=_REQUEST_BUCKETS, **kw).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", **kw).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", **kw).labels(model_name)
        self._engine = _EngineCollector(model_name, compilations)
        self.registry.register(self._engine)
        self._http: Any = None

    def watch(self, engine: Engine) -> None:
        """Reports this engine's gauges from now on."""
        self._engine.engine = engine

    def count(self, request: Request, update: Any, *, first: bool) -> None:
        """Counts an update of a stream's: its tokens, the first token's times (`first`: none came before), and the
        request's latencies once it finished."""
        if first and update.token_ids:
            self.first_token(request)
        self.generation_tokens.inc(len(update.token_ids))
        if update.finish_reason is not None:
            self.finished(request)

    def first_token(self, request: Request) -> None:
        """Observes time to first token and queue time once the first token has been sampled."""
        self.ttft.observe(request.token_times[0] - request.submitted_at)
        if request.scheduled_at is not None:
            self.queue_time.observe(max(0.0, request.scheduled_at - request.submitted_at))

    def finished(self, request: Request) -> None:
        """Observes a successfully finished request's inter-token gaps and end-to-end latency."""
        times = request.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if times:
            self.e2e.observe(times[-1] - request.submitted_at)

    def serve(self, host: str, port: int, token: str | None = None) -> int:
        """Serves /metrics over HTTP on a daemon thread, with `token` only to `authorization: Bearer <token>`;
        returns the bound port."""
        app = make_wsgi_app(self.registry)
        self._http = make_server(host, port, _bearer(app, token) if token else app, _ThreadingServer, _QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="jaxserve-metrics", daemon=True).start()
        return int(self._http.server_port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # every scrape would log a line
        pass


def _bearer(app: Any, token: str) -> Any:
    """`app` behind `authorization: Bearer <token>` (compared in constant time); 401 otherwise."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        if hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"send the header 'Authorization: Bearer <metrics token>'\n"]

    return guarded
