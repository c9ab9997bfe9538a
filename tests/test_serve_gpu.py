"""`jaxserve serve` as users start it, on the GPU: each shipped serve config with its model replaced by a random model
of the same shape, started as a subprocess and called over gRPC by 64 concurrent streams of mixed lengths (some
cancelled, some with stop strings, some long enough to preempt each other), then drained by SIGTERM.

The page pool is the one thing changed besides the model (and the ports and the compilation cache's directory):
shrunk so that the long requests cannot all hold their pages at once, where the config runs more than one slot.
Set JAXSERVE_TEST_XLA_CACHE to share compilations between runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from jaxserve.client import Client, Completion
from jaxserve.config import EngineConfig, ServerConfig
from tests.helpers import free_port, wait_until

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {  # shipped config -> the random model of its model's shape
    "configs/serve.yaml": "random:smollm2-135m",
    "k8s/overlays/gpu/serve.yaml": "random:llama3-8b",
    "configs/serve-int8-latency.yaml": "random:llama3-8b",
}
LONG, CANCELLED, STOPPED = range(0, 8), range(8, 16), range(16, 24)  # the rest are short
STOP = "<1"  # the random models' tokens are "<id>": about a third of them start so


def metrics(port: int) -> dict[str, float]:
    """The server's unlabelled-by-bucket metrics, by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(jaxserve:\w+)\{[^}]*\} (\S+)$", text, re.M)}


def long_request(engine: dict, max_tokens_limit: int) -> tuple[int, int, int]:
    """(prompt tokens, max_tokens, pages) of a long request that fits a slot of this engine."""
    seq = engine["page_size"] * engine["max_pages_per_slot"]
    prompt, out = min(1500, seq // 2), min(600, max_tokens_limit, seq // 4)
    return prompt, out, -(-(prompt + out) // engine["page_size"])


def served_config(shipped: str, tmp_path: Path) -> tuple[Path, dict]:
    cfg = yaml.safe_load((REPO / shipped).read_text())
    cfg.update(host="127.0.0.1", port=free_port(), http_port=free_port(), metrics_host="127.0.0.1", metrics_port=free_port(),
               model=CONFIGS[shipped], drain_timeout_s=120)
    cfg.setdefault("max_tokens_limit", ServerConfig().max_tokens_limit)
    engine = cfg.setdefault("engine", {})
    for name in ("page_size", "max_pages_per_slot", "max_slots"):
        engine.setdefault(name, getattr(EngineConfig(), name))
    engine["compilation_cache_dir"] = os.environ.get("JAXSERVE_TEST_XLA_CACHE") or str(tmp_path / "xla")
    if engine["max_slots"] > 1:  # room for four long requests at a time, not all eight
        pages = long_request(engine, cfg["max_tokens_limit"])[2]
        engine.update(kv_memory_fraction=0.0, num_pages=max(engine["max_pages_per_slot"], 4 * pages))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@pytest.mark.parametrize("shipped", list(CONFIGS))
def test_shipped_config_serves_64_mixed_streams_and_drains(shipped, tmp_path):
    path, cfg = served_config(shipped, tmp_path)
    engine = cfg["engine"]
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}  # as k8s/overlays/gpu's deployment sets it
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--config", str(path)], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with Client(f"127.0.0.1:{cfg['port']}") as client:
            try:
                client.wait_until_serving(600, alive=lambda: proc.poll() is None)
            except (RuntimeError, TimeoutError) as e:
                raise AssertionError(f"{e}:\n{log_path.read_text()[-5000:]}") from None
            info = client.model_info()
            results = run_mixed_load(client, cfg, info.vocab_size)
            check_results(results)
            seen = {}

            def idle() -> bool:
                seen.update(metrics(cfg["metrics_port"]))
                return (seen["jaxserve:num_requests_running"], seen["jaxserve:num_requests_waiting"],
                        seen["jaxserve:kv_cache_usage_perc"]) == (0, 0, 0)

            wait_until(idle, 30, "every slot and page to be free again", poll=0.2)
            if engine["max_slots"] > 1:  # (one slot never preempts)
                assert seen["jaxserve:num_preemptions_total"] > 0, "the long requests preempted each other"
            # the OpenAI-compatible API on the same engine
            body = json.dumps({"prompt": [5] * 16, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
            post = urllib.request.Request(f"http://127.0.0.1:{cfg['http_port']}/v1/completions", data=body,
                                          headers={"Content-Type": "application/json"})
            completion = json.loads(urllib.request.urlopen(post, timeout=120).read())
            usage = completion["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (16, 8, 24), usage
            # SIGTERM mid-stream: the call in flight finishes, new calls are refused, the process exits 0
            call = client.generate(token_ids=[5] * 16, max_tokens=100, ignore_eos=True)
            drained = Completion()
            drained.add(next(call))
            proc.send_signal(signal.SIGTERM)
            for response in call:
                drained.add(response)
            assert (drained.finish_reason, drained.completion_tokens) == ("length", 100)
            assert proc.wait(timeout=60) == 0, log_path.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "compiled" in log_path.read_text(), "start-up logs its compile progress"


def run_mixed_load(client: Client, cfg: dict, vocab: int) -> dict[int, tuple[dict, Completion | grpc.RpcError]]:
    """64 streams at once -> each one's (request, its gathered stream or its error), by index; an index's kind is
    given by LONG, CANCELLED, STOPPED (short otherwise)."""
    rng = np.random.default_rng(0)
    long_prompt, long_out, _ = long_request(cfg["engine"], cfg["max_tokens_limit"])
    requests = []
    for i in range(64):
        n, out = (long_prompt, long_out) if i in LONG else (int(rng.integers(1, 300)), int(rng.integers(1, 64)))
        out = 200 if i in CANCELLED else out  # (cancelled after its first chunk)
        kwargs = {"stop": [STOP], "max_tokens": 64} if i in STOPPED else {"max_tokens": out, "ignore_eos": True}
        # (the last id is the end-of-sequence token)
        requests.append({"token_ids": rng.integers(0, vocab - 1, n).tolist(), "request_id": f"r{i}", **kwargs})
    results: dict[int, tuple[dict, Completion | grpc.RpcError]] = {}

    def one(i: int) -> None:
        call = client.generate(timeout=600, **requests[i])
        result = Completion()
        try:
            for response in call:
                result.add(response)
                if i in CANCELLED:
                    call.cancel()
            results[i] = (requests[i], result)
        except grpc.RpcError as e:
            results[i] = (requests[i], e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:  # the long ones first, so that they hold slots together
        t.start()
    for t in threads:
        t.join()
    return results


def check_results(results: dict[int, tuple[dict, Completion | grpc.RpcError]]) -> None:
    stopped = 0
    for i in range(64):
        request, result = results[i]
        if i in CANCELLED:
            assert isinstance(result, grpc.RpcError) and result.code() == grpc.StatusCode.CANCELLED, (i, result)
            continue
        assert isinstance(result, Completion) and result.request_id == request["request_id"], (i, result)
        assert len(result.token_ids) == result.completion_tokens <= request["max_tokens"], (i, result)
        if i in STOPPED:
            assert STOP not in result.text and result.finish_reason in ("stop", "length"), (i, result)
            stopped += result.finish_reason == "stop"
        else:
            assert (result.finish_reason, result.completion_tokens) == ("length", request["max_tokens"]), (i, result)
    assert stopped, "some stop string was met"

