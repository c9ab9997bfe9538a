"""The gRPC server on loopback with a real client, over the embedded model.

One engine serves the module; most tests use one server over it, and the tests that need another
configuration (queue bound, TLS, auth) start a second server over the same engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxserve.client import TLS, AsyncClient, Client
from jaxserve.config import ServerConfig
from jaxserve.engine.engine import Engine
from jaxserve.runner import build_engine, compilation_count
from jaxserve.server.server import Server, model_info
from tests import certs
from tests.helpers import SERVING_ENGINE, free_port, wait_until

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = SERVING_ENGINE
PARIS = "The capital of France is"
LONG = {"max_tokens": 100, "ignore_eos": True}  # a stream that outlives the test's interest in it


@pytest.fixture(scope="module")
def engine(smollm):
    engine = build_engine(smollm, ENGINE)
    engine.start()
    yield engine
    engine.stop()


def start_server(running: Engine, model, **overrides) -> Server:
    """A server over the started engine `running`; `overrides` are ServerConfig fields (its `engine` too)."""
    cfg = ServerConfig(**{"host": "127.0.0.1", "port": 0, "http_port": 0, "metrics_port": 0, "engine": ENGINE,
                          "max_message_bytes": 64 * 1024, "max_tokens_limit": 100, **overrides})
    server = Server(cfg, model_name="smollm2", compilations=compilation_count)
    server.start()
    server.attach(running, model_info(model, running, cfg, dtype="float32"))
    return server


@pytest.fixture(scope="module")
def server(engine, smollm):
    server = start_server(engine, smollm)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(f"127.0.0.1:{server.port}") as client:
        yield client


def pool_is_free(engine: Engine) -> bool:
    s = engine.scheduler
    return (s.slots.num_free == engine.cfg.max_slots and not s.running and not s.waiting
            and all(ref == 0 for ref in s.pages.refs))


def rpc_error(call_result) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        for _ in call_result:
            pass
    return info.value


def jaxserve_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


# -- output ----------------------------------------------------------------------------------
def test_streaming_output_equals_jaxserve_generate(client):
    prompts = [PARIS, "def add(a, b):"]
    proc = jaxserve_cli("generate", "--json", "--max-tokens", "12", *prompts)
    assert proc.returncode == 0, proc.stderr
    expected = [json.loads(line) for line in proc.stdout.splitlines()]
    for prompt, want in zip(prompts, expected):
        chunks, completions = [], []
        for response in client.generate(prompt=prompt, max_tokens=12, request_id="mine"):
            assert response.request_id == "mine"
            (chunks if response.HasField("chunk") else completions).append(response)
        assert [t for c in chunks for t in c.chunk.token_ids] == want["token_ids"]
        assert "".join(c.chunk.text for c in chunks) == want["text"]
        assert all(len(c.chunk.token_ids) == 1 for c in chunks), "one chunk per token"
        assert len(completions) == 1
        usage = completions[0].completion.usage
        assert usage.prompt_tokens == len(want["prompt_token_ids"]) and usage.completion_tokens == len(want["token_ids"])
        assert client.complete(prompt=prompt, max_tokens=12).finish_reason == want["finish_reason"]
    assert expected[0]["text"].startswith(" Paris")


def test_chat_messages_token_ids_and_logprobs(client, smollm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = smollm.tokenizer.encode_chat(messages)
    assert client.tokenize(messages=messages) == chat_ids
    by_chat = client.complete(messages=messages, max_tokens=8)
    by_ids = client.complete(token_ids=chat_ids, max_tokens=8, logprobs=3)
    assert by_chat.token_ids == by_ids.token_ids and by_chat.prompt_tokens == len(chat_ids)
    assert "Paris" in by_chat.text
    assert [lp.token_id for lp in by_ids.logprobs] == by_ids.token_ids
    for lp in by_ids.logprobs:
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
        assert lp.top[0].logprob == pytest.approx(lp.logprob) and lp.logprob <= 0
    stopped = client.complete(prompt=PARIS, max_tokens=12, stop=["."])
    assert stopped.text == " Paris" and stopped.finish_reason == "stop"


def test_sampling_fields_n_samples_and_prompt_logprobs(client, smollm):
    """The vLLM sampling fields over gRPC: n samples stream interleaved, each message with its index, then a
    completion each; prompt log-probabilities come in a sample's first chunk."""
    london = smollm.tokenizer.encode(" London")[0]
    biased = client.complete(prompt=PARIS, max_tokens=3, logit_bias={london: 100.0})
    assert biased.token_ids == [london] * 3
    plain = client.complete(prompt=PARIS, max_tokens=6).token_ids
    penalised = client.complete(prompt=PARIS, max_tokens=6, repetition_penalty=1.5, presence_penalty=2.0,
                                frequency_penalty=1.0, min_p=0.1, min_tokens=6)
    assert len(penalised.token_ids) == 6 and penalised.token_ids != plain
    responses = list(client.generate(prompt=PARIS, max_tokens=5, temperature=1.0, seed=3, n=3, prompt_logprobs=2))
    samples: dict[int, list[int]] = {}
    completions = [r.completion for r in responses if r.HasField("completion")]
    assert sorted(c.index for c in completions) == [0, 1, 2]
    for r in responses:
        if r.HasField("chunk"):
            if r.chunk.index not in samples:
                prompt = list(r.chunk.prompt_logprobs)
                assert [e.token_id for e in prompt] == client.tokenize(prompt=PARIS)[1:]
                assert all(len(e.top) == 2 and e.logprob <= 0 for e in prompt)
            samples.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
    assert len({tuple(v) for v in samples.values()}) == 3 and all(len(v) == 5 for v in samples.values())
    with pytest.raises(grpc.RpcError) as error:
        client.complete(prompt=PARIS, max_tokens=4, n=17)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n=17" in error.value.details()


def test_model_info_and_tokenize(client, smollm):
    info = client.model_info()
    assert info.vocab_size == 49152 and info.context_length == 8192 and info.architecture == "llama"
    assert info.max_sequence_length == ENGINE.max_seq_len and info.max_slots == ENGINE.max_slots
    assert info.max_tokens_limit == 100 and info.max_logprobs == 20 and info.has_chat_template
    assert list(info.eos_token_ids) == list(smollm.tokenizer.eos_token_ids) and info.dtype == "float32"
    assert client.tokenize(prompt=PARIS) == [504, 3575, 282, 4649, 314]


def test_64_concurrent_streams_all_complete_correctly(server, client, engine):
    prompts = [PARIS, "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
    expected = [client.complete(prompt=p, max_tokens=6, ignore_eos=True) for p in prompts]

    async def run_all():
        async with AsyncClient(f"127.0.0.1:{server.port}") as ac:
            return await asyncio.gather(*(ac.complete(prompt=prompts[i % 4], max_tokens=6, ignore_eos=True,
                                                      request_id=f"r{i}") for i in range(64)))

    rows_before = engine.stats.max_decode_rows
    results = asyncio.run(run_all())
    for i, result in enumerate(results):
        want = expected[i % 4]
        assert result.request_id == f"r{i}"
        assert (result.token_ids, result.text, result.finish_reason) == (want.token_ids, want.text, "length")
        assert (result.prompt_tokens, result.completion_tokens) == (want.prompt_tokens, 6)
    assert max(rows_before, engine.stats.max_decode_rows) >= 4, "the streams were batched"
    wait_until(lambda: pool_is_free(engine), what="a free pool")
    assert server.service.in_flight == 0


# -- cancellation ----------------------------------------------------------------------------
def test_cancel_mid_stream_frees_the_slot_and_pages(client, engine):
    call = client.generate(prompt=PARIS, **LONG)
    next(call)
    next(call)
    assert engine.scheduler.slots.num_free == ENGINE.max_slots - 1
    call.cancel()
    assert rpc_error(call).code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: pool_is_free(engine), timeout=5, what="the cancelled request's slot and pages")


def test_expired_deadline_frees_the_slot_and_pages(client, engine):
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        client.complete(prompt=PARIS, timeout=1.0, **LONG)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5
    wait_until(lambda: pool_is_free(engine), timeout=5, what="the expired request's slot and pages")


# -- bad input -------------------------------------------------------------------------------
BAD_INPUTS = [
    ({"prompt": ""}, "prompt='' must be a non-empty string"),
    ({"token_ids": []}, "token_ids.ids=[] must be a non-empty list of token ids"),
    ({"messages": []}, "messages.messages=[] must be a non-empty list"),
    ({"token_ids": [1, 49152]}, "token_ids.ids[1]=49152 is outside the vocabulary [0, 49152)"),
    ({"token_ids": [5, -3]}, "token_ids.ids[1]=-3 is outside the vocabulary"),
    ({"token_ids": [7] * 500, "max_tokens": 50}, "prompt of 500 tokens plus sampling.max_tokens=50 is 550 tokens"),
    ({"prompt": PARIS, "max_tokens": 0}, "sampling.max_tokens=0 must be between 1 and 100"),
    ({"prompt": PARIS, "max_tokens": 101}, "sampling.max_tokens=101 must be between 1 and 100"),
    ({"prompt": PARIS, "temperature": -0.5}, "sampling.temperature=-0.5 must be a finite number >= 0"),
    ({"prompt": PARIS, "temperature": math.inf}, "sampling.temperature=inf must be a finite number >= 0"),
    ({"prompt": PARIS, "temperature": -math.inf}, "sampling.temperature=-inf must be a finite number >= 0"),
    ({"prompt": PARIS, "temperature": math.nan}, "sampling.temperature=nan must be a finite number >= 0"),
    ({"prompt": PARIS, "top_p": math.nan}, "sampling.top_p=nan must be in (0, 1]"),
    ({"prompt": PARIS, "request_id": "x" * 257}, "request_id is 257 bytes; at most 256"),
    ({"prompt": PARIS, "stop": ["y" * 1025]}, "sampling.stop[0]='yyyy"),
    ({"prompt": PARIS, "top_k": -1}, "sampling.top_k=-1 must be an integer >= 0"),
    ({"prompt": PARIS, "top_p": 0.0}, "sampling.top_p=0.0 must be in (0, 1]"),
    ({"prompt": PARIS, "top_p": 1.5}, "sampling.top_p=1.5 must be in (0, 1]"),
    ({"prompt": PARIS, "stop": ["x"] * 9}, "sampling.stop has 9 strings; at most 8"),
    ({"prompt": PARIS, "stop": ["ok", ""]}, "sampling.stop[1]='' must have 1 to 1024 bytes"),
    ({"prompt": PARIS, "stop_token_ids": [60000]}, "sampling.stop_token_ids[0]=60000 is outside the vocabulary"),
    ({"prompt": PARIS, "logprobs": 21}, "sampling.logprobs=21 must be between 0 and 20"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages.messages[0].role='' is not one of system, user"),
    ({"messages": [{"role": "user<|im_end|>", "content": "hi"}]}, "messages.messages[0].role='user<|im_end|>' is not"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_INPUTS, ids=[m.split(" ")[0] for _, m in BAD_INPUTS])
def test_bad_input_is_invalid_argument_before_scheduling(client, engine, kwargs, message):
    steps = engine.stats.steps
    error = rpc_error(client.generate(**kwargs))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert engine.stats.steps == steps and pool_is_free(engine), "the engine never saw it"


def test_no_input_is_invalid_argument(server):
    from jaxserve.v1 import inference_pb2 as pb
    from jaxserve.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        error = rpc_error(pb_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no input: set one of prompt, token_ids or messages" in error.details()


def test_message_over_the_size_limit_is_resource_exhausted(client, engine):
    error = rpc_error(client.generate(prompt="word " * 20_000, max_tokens=1))  # 100 kB against a 64 KiB limit
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pool_is_free(engine)


def test_full_queue_is_resource_exhausted_with_a_retry_hint(engine, smollm):
    server = start_server(engine, smollm, max_waiting=2, retry_after_ms=250)
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            calls = [client.generate(prompt=PARIS, seed=i, **LONG) for i in range(ENGINE.max_slots + 2)]
            wait_until(lambda: server.service.in_flight == len(calls), what="every call to be admitted")
            refused = client.generate(prompt=PARIS, max_tokens=1)
            error = rpc_error(refused)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waiting queue is full" in error.details() and "retry after 250 ms" in error.details()
            assert dict(refused.trailing_metadata())["retry-after-ms"] == "250"
            for call in calls:
                call.cancel()
            wait_until(lambda: pool_is_free(engine) and server.service.in_flight == 0, what="a free pool")
            assert client.complete(prompt=PARIS, max_tokens=2).completion_tokens == 2, "room again"
    finally:
        server.stop()


# -- faults ----------------------------------------------------------------------------------
class PoisonSeed:
    """Wraps the real runner; rows sampled with `seed` get a NaN log-probability, as NaN logits would."""

    def __init__(self, runner, seed: int) -> None:
        self.runner, self.seed = runner, seed

    def dispatch(self, inp):
        fetch = self.runner.dispatch(inp)
        rows = np.flatnonzero(inp.seeds == self.seed)

        def poisoned():
            out = fetch()
            out.logprobs = out.logprobs.copy()
            out.logprobs[rows] = math.nan
            return out

        return poisoned



def test_non_finite_logits_fail_one_call_with_internal_and_the_others_finish(client, engine):
    want = client.complete(prompt=PARIS, max_tokens=8, ignore_eos=True)
    real = engine.runner
    engine.runner = PoisonSeed(real, seed=666)
    try:
        good = client.generate(prompt=PARIS, max_tokens=8, ignore_eos=True)
        bad = client.generate(prompt="Hello there", max_tokens=8, ignore_eos=True, seed=666)
        error = rpc_error(bad)
        got = [t for r in good if r.HasField("chunk") for t in r.chunk.token_ids]
    finally:
        engine.runner = real
    assert error.code() == grpc.StatusCode.INTERNAL and "logits turned non-finite" in error.details()
    assert got == want.token_ids
    wait_until(lambda: pool_is_free(engine), what="a free pool")
    assert client.health() == "SERVING"


class FailFirstDispatch:
    """Wraps the real runner; the first dispatch raises before anything reaches the device."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def dispatch(self, inp):
        raise RuntimeError("injected device failure")



def test_a_failing_step_fails_calls_with_internal_and_health_goes_not_serving(engine, smollm, caplog):
    doomed = Engine(FailFirstDispatch(engine.runner), smollm.tokenizer, ENGINE, vocab_size=engine.vocab_size,
                    context_len=engine.context_len)
    server = start_server(doomed, smollm)
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            assert client.health() == "SERVING"
            calls = [client.generate(prompt=PARIS, max_tokens=4) for _ in range(2)]
            wait_until(lambda: server.service.in_flight == 2, what="both calls to be admitted")
            with caplog.at_level(logging.ERROR):
                doomed.start()
                errors = [rpc_error(call) for call in calls]
            for error in errors:
                assert error.code() == grpc.StatusCode.INTERNAL
                assert error.details() == "engine step failed: RuntimeError: injected device failure"
            assert client.health() == "NOT_SERVING"
            assert client.health("jaxserve.v1.InferenceService") == "NOT_SERVING"
            assert "engine step failed" in caplog.text and "health is NOT_SERVING" in caplog.text
            late = rpc_error(client.generate(prompt=PARIS, max_tokens=4))
            assert late.code() == grpc.StatusCode.UNAVAILABLE and "stopped after a fault" in late.details()
    finally:
        server.stop()
        doomed.stop()


# -- health, reflection, metrics -------------------------------------------------------------
def test_health_is_not_serving_until_the_engine_is_attached(engine, smollm):
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=None, engine=ENGINE)
    server = Server(cfg)
    server.start()
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            assert client.health() == "NOT_SERVING"
            error = rpc_error(client.generate(prompt=PARIS, max_tokens=2))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in error.details()
            server.attach(engine, model_info(smollm, engine, cfg, dtype="float32"))
            assert client.health() == client.health("jaxserve.v1.InferenceService") == "SERVING"
            assert client.complete(prompt=PARIS, max_tokens=2).completion_tokens == 2
    finally:
        server.stop()


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "jaxserve.v1.InferenceService" in services and "grpc.health.v1.Health" in services
        method = db.FindFileContainingSymbol("jaxserve.v1.InferenceService").service[0].method[0]
        assert (method.name, method.server_streaming) == ("Generate", True)


METRICS = ["time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
           "request_queue_time_seconds_count", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
           "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total", "compilations_total"]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:") and "{" in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            if "_bucket" not in name:
                values[name.removeprefix("jaxserve:")] = float(value)
    return values


def test_metrics_on_their_own_port(server, client):
    before = scrape(server.metrics_port)
    client.complete(prompt=PARIS, max_tokens=5, ignore_eos=True)
    after = scrape(server.metrics_port)
    assert set(METRICS) <= set(after), sorted(set(METRICS) - set(after))
    assert after["generation_tokens_total"] - before.get("generation_tokens_total", 0) == 5
    assert after["prompt_tokens_total"] - before.get("prompt_tokens_total", 0) == 5
    assert after["time_to_first_token_seconds_count"] - before.get("time_to_first_token_seconds_count", 0) == 1
    assert after["inter_token_latency_seconds_count"] - before.get("inter_token_latency_seconds_count", 0) == 4
    assert after["e2e_request_latency_seconds_count"] - before.get("e2e_request_latency_seconds_count", 0) == 1
    assert after["num_requests_running"] == 0 and 0 <= after["kv_cache_usage_perc"] <= 1
    assert after["compilations_total"] >= len(ENGINE.decode_buckets) + len(ENGINE.chunk_buckets)


# -- security --------------------------------------------------------------------------------
def test_bearer_token_is_required_on_inference_calls_and_health_stays_open(engine, smollm):
    server = start_server(engine, smollm, auth_token="s3cret-token")
    address = f"127.0.0.1:{server.port}"
    try:
        for token, why in ((None, "missing authorization"), ("s3cret-toke", "wrong bearer token")):
            with Client(address, token=token) as client:
                error = rpc_error(client.generate(prompt=PARIS, max_tokens=2))
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED and why in error.details()
                with pytest.raises(grpc.RpcError) as info:
                    client.model_info()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.health() == "SERVING"
        with Client(address, token="s3cret-token") as client:
            assert client.complete(prompt=PARIS, max_tokens=3).text.startswith(" Paris")
    finally:
        server.stop()


def test_tls_and_mutual_tls_round_trips(engine, smollm, tmp_path):
    ca = certs.CA()
    key, cert = ca.issue("localhost", server=True)
    files = {"tls_key": certs.write(str(tmp_path), "server.key", key),
             "tls_cert": certs.write(str(tmp_path), "server.pem", cert)}
    tls_server = start_server(engine, smollm, http_port=free_port(), **files)
    try:
        with Client(f"localhost:{tls_server.port}", tls=TLS(root_certificates=ca.pem)) as client:
            assert client.complete(prompt=PARIS, max_tokens=3).text.startswith(" Paris")
        with Client(f"localhost:{tls_server.port}") as plaintext:
            assert rpc_error(plaintext.generate(prompt=PARIS, max_tokens=2)).code() == grpc.StatusCode.UNAVAILABLE
        # HTTP takes the same certificate
        import ssl

        body = json.dumps({"prompt": PARIS, "max_tokens": 3, "temperature": 0}).encode()
        trusted = ssl.create_default_context(cadata=ca.pem.decode())
        request = urllib.request.Request(f"https://localhost:{tls_server.http_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, context=trusted, timeout=60).read())
        assert answer["choices"][0]["text"].startswith(" Paris")
        with pytest.raises(urllib.error.URLError):  # an untrusted certificate
            urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=60)
    finally:
        tls_server.stop()

    ca_path = certs.write(str(tmp_path), "ca.pem", ca.pem)
    mtls_server = start_server(engine, smollm, tls_client_ca=ca_path, **files)
    try:
        client_key, client_cert = ca.issue("a client", server=False)
        mutual = TLS(root_certificates=ca.pem, private_key=client_key, certificate_chain=client_cert)
        with Client(f"localhost:{mtls_server.port}", tls=mutual) as client:
            assert client.complete(prompt=PARIS, max_tokens=3).text.startswith(" Paris")
        stranger_key, stranger_cert = certs.CA("another CA").issue("a stranger", server=False)
        for tls in (TLS(root_certificates=ca.pem),
                    TLS(root_certificates=ca.pem, private_key=stranger_key, certificate_chain=stranger_cert)):
            with Client(f"localhost:{mtls_server.port}", tls=tls) as client:
                assert rpc_error(client.generate(prompt=PARIS, max_tokens=2)).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        mtls_server.stop()


# -- command line ----------------------------------------------------------------------------
def test_client_generate_streams_to_the_terminal(server):
    proc = jaxserve_cli("client", "generate", "--address", f"127.0.0.1:{server.port}", "--max-tokens", "8", PARIS,
                        timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" Paris")
    bad = jaxserve_cli("client", "generate", "--address", f"127.0.0.1:{server.port}", "--max-tokens", "0", PARIS,
                       timeout=120)
    assert bad.returncode == 1 and "INVALID_ARGUMENT: sampling.max_tokens=0" in bad.stderr


def test_sigterm_drains_in_flight_calls_and_exits_zero(tmp_path):
    port, http_port = free_port(), free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({"host": "127.0.0.1", "http_port": http_port, "metrics_port": None,  # (JSON is YAML)
                                  "drain_timeout_s": 60, "max_tokens_limit": 200, "engine": dataclasses.asdict(ENGINE)}))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--config", str(config), "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(300, alive=lambda: proc.poll() is None)
            call = client.generate(prompt=PARIS, max_tokens=120, ignore_eos=True)
            responses = [next(call)]
            rest: list = []
            reader = threading.Thread(target=lambda: rest.extend(call))
            reader.start()
            # and one over HTTP, streamed
            body = json.dumps({"prompt": PARIS, "max_tokens": 120, "ignore_eos": True, "stream": True}).encode()
            sse = urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                headers={"Content-Type": "application/json"}), timeout=120)
            first_event = sse.readline()
            events: list[bytes] = [first_event]
            http_reader = threading.Thread(target=lambda: events.extend(sse))
            http_reader.start()
            proc.send_signal(15)
            wait_until(lambda: client.health(timeout=2) == "NOT_SERVING", timeout=10, what="NOT_SERVING")
            refused = rpc_error(client.generate(prompt=PARIS, max_tokens=2))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.details()
            reader.join(timeout=120)
            http_reader.join(timeout=120)
            responses += rest
        assert responses[-1].HasField("completion"), "the in-flight stream finished"
        assert responses[-1].completion.usage.completion_tokens == 120
        chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        assert events[-2].strip() == b"data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) == 120, "the HTTP stream finished too"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_compiling_ends_the_server_within_5_s(tmp_path, signum):
    config = tmp_path / "serve.yaml"
    config.write_text("host: 127.0.0.1\nhttp_port: 0\nmetrics_port: null\nengine:\n  max_slots: 2\n  num_pages: 32\n"
                      "  max_pages_per_slot: 16\n  chunk_buckets: [16, 32, 64]\n")
    # a cache of its own: the buckets really compile when the signal comes
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--config", str(config), "--port",
                             str(free_port())], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert proc.stdout is not None
        log = []
        for line in proc.stdout:
            log.append(line)
            if "step buckets in" in line and "lowered" in line:
                break
        assert not any("first run" in line for line in log), "".join(log)  # still compiling
        sent = time.perf_counter()
        proc.send_signal(signum)
        code = proc.wait(timeout=30)
        assert time.perf_counter() - sent < 5, "".join(log)
        assert code == 128 + signum
        assert "received while loading: exiting without serving" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
