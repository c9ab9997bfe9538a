"""`jaxserve serve` as a platform team runs it: start-up time and throughput over gRPC, each against a baseline of
the same run.

1. Time from process start to SERVING with a serve config (default: k8s/overlays/gpu/serve.yaml, every bucket) and
   an empty compilation cache, then again on a restart with the cache filled; SIGTERM's exit in between.
2. Output tokens/s of C streaming gRPC clients (I tokens in, O out, each client one request, all at once, spread
   over client processes so that the clients' GIL is not the bottleneck) against `jaxserve bench --config` with
   the same config and load (the engine in-process, no server); TTFT and ITL p50/p99 as the clients saw them.

    PYTHONPATH=. python3 benchmarks/serve_gpu.py [--config k8s/overlays/gpu/serve.yaml] [--model random:llama3-8b]
        [--clients 256 --input-len 1000 --output-len 1000] [--log-dir DIR]
    .venv/bin/python benchmarks/serve_gpu.py --config configs/serve.yaml --model embedded --clients 32 \
        --input-len 128 --output-len 64 --client-processes 2 --out benchmarks/results/serve_cpu.jsonl   # on a CPU

The model is replaced (a random one of real shape: no checkpoint travels to the lent GPU), and so are the ports
and the cache directory; the rest is the config as shipped. XLA_PYTHON_CLIENT_MEM_FRACTION is 0.95, as the GPU
deployment sets it. Rows go to benchmarks/results/serve_gpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import REPO, cli_bench, record  # noqa: E402
from jaxserve.bench import percentile  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`jaxserve serve --config PATH` as a subprocess, its output in a log file."""

    def __init__(self, config: str, port: int, log_path: str) -> None:
        self.log_path, self.address = log_path, f"127.0.0.1:{port}"
        self.started = time.monotonic()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--config", config], cwd=REPO,
                                         env=ENV, stdout=log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout: float) -> float:
        """Seconds from the process's start to SERVING."""
        from jaxserve.client import Client

        with Client(self.address) as client:
            try:
                client.wait_until_serving(timeout, alive=lambda: self.proc.poll() is None)
            except (RuntimeError, TimeoutError) as e:
                self.kill()
                raise SystemExit(f"{e}; the server's log:\n{self.log()[-6000:]}") from None
        return time.monotonic() - self.started

    def terminate(self, timeout: float = 120) -> tuple[int, float]:
        """SIGTERM -> (exit code, seconds to exit)."""
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout), time.monotonic() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def client_process(address: str, prompts: list[list[int]], output_len: int, start_at: float, queue) -> None:
    """One process's streaming clients, each on its own thread and channel, all starting at `start_at` (wall clock);
    puts (ttft list, itl list, tokens, first start, last end) on `queue`."""
    import threading

    from jaxserve.client import Client

    ttft: list[float] = []
    itl: list[float] = []
    ends: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def one(prompt: list[int]) -> None:
        with Client(address) as client:
            time.sleep(max(0.0, start_at - time.time()))
            start = last = time.perf_counter()
            first, gaps, count = None, [], 0
            for response in client.generate(token_ids=prompt, max_tokens=output_len, ignore_eos=True, timeout=1800):
                if response.HasField("chunk") and response.chunk.token_ids:
                    now = time.perf_counter()
                    if first is None:
                        first = now - start
                    else:
                        gaps.append((now - last) / len(response.chunk.token_ids))
                    last = now
                    count += len(response.chunk.token_ids)
        assert count == output_len, f"a stream got {count} tokens, not {output_len}"
        with lock:
            ttft.append(first or 0.0)
            itl.extend(gaps)
            tokens[0] += count
            ends.append(time.time())

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put((ttft, itl, tokens[0], max(ends)))


def http_client_process(base_url: str, prompts: list[list[int]], output_len: int, start_at: float, queue) -> None:
    """One process's streaming clients through the async `openai` client, all starting at `start_at`; puts what
    `client_process` puts."""
    import asyncio

    import openai

    async def run() -> tuple[list[float], list[float], int, float]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=1800)
        ttft: list[float] = []
        itl: list[float] = []
        counts = [0]

        async def one(prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            start = last = time.perf_counter()
            first = None
            stream = await client.completions.create(model=None, prompt=prompt, max_tokens=output_len, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            count = 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    now = time.perf_counter()
                    if first is None:
                        first = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    count += 1
            ttft.append(first or 0.0)
            counts[0] += count

        await asyncio.gather(*(one(p) for p in prompts))
        await client.close()
        return ttft, itl, counts[0], time.time()

    queue.put(asyncio.run(run()))


def grpc_load(address: str, prompts: list[list[int]], output_len: int, processes: int,
              target: Any = None) -> dict[str, float]:
    """N streaming clients at once, spread over `processes` (gRPC by default; `target` = http_client_process with
    `address` the API's base URL for HTTP)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 5 + len(prompts) / 64  # every process's channels open before the start line
    procs = [ctx.Process(target=target or client_process,
                         args=(address, prompts[i::processes], output_len, start_at, queue))
             for i in range(processes)]
    for p in procs:
        p.start()
    parts = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    ttft = [x for part in parts for x in part[0]]
    itl = [x for part in parts for x in part[1]]
    tokens, wall = sum(part[2] for part in parts), max(part[3] for part in parts) - start_at
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": percentile(ttft, 0.99), "itl_p50_s": statistics.median(itl),
            "itl_p99_s": percentile(itl, 0.99)}


def preset_vocab(model: str) -> int:
    from jaxserve.checkpoint.random_model import preset

    return preset(model).vocab_size


def stdlib_bpe(work: str, vocab: int) -> str:
    """A byte-level BPE of up to `vocab` tokens learnt from the Python standard library's sources (a random model's
    word-level tokenizer spells no JSON); returns its directory (tokenizer.json, its end of sequence)."""
    import pathlib
    import sysconfig

    import tokenizers

    files = pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer, tok.decoder = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), tokenizers.decoders.ByteLevel()
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files if "-packages" not in str(f)),
                            tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|eos|>"], show_progress=False,
                                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    out = os.path.join(work, "stdlib-bpe")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|eos|>"}, f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k8s/overlays/gpu/serve.yaml")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--parts", default="start,load,sampling,structured",
                    help="start (cold and warm start-up), load (gRPC and HTTP against bench), sampling (bench's decode "
                         "step with penalties, min_p and logit_bias on every row against greedy rows), structured "
                         "(bench's 64 rows under a JSON schema against 64 free rows, and the masks' host time)")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary directory)")
    ap.add_argument("--out", default="benchmarks/results/serve_gpu.jsonl")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    logs = args.log_dir or tempfile.mkdtemp(prefix="serve-gpu-")
    os.makedirs(logs, exist_ok=True)
    work = tempfile.mkdtemp(prefix="serve-gpu-cache-")
    with open(os.path.join(REPO, args.config)) as f:
        cfg = yaml.safe_load(f)
    port = free_port()
    http_port = free_port()
    cfg.update(host="127.0.0.1", port=port, http_port=http_port, metrics_port=None)
    if args.model != "embedded":
        cfg["model"] = args.model
    cfg.setdefault("engine", {})["compilation_cache_dir"] = os.path.join(work, "xla")
    config = os.path.join(work, "serve.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    base = {"config": args.config, "model": args.model}
    rows = []  # recorded at the end: recording asks JAX for the device, which would take the GPU's memory

    def bench(requests: int, input_len: int, output_len: int, flags: tuple[str, ...] = ()) -> dict:
        """`jaxserve bench --config` (the in-process engine of the served config): its JSON result."""
        model = [] if args.model == "embedded" else ["--model", args.model]
        result = cli_bench(["--config", config, *model, "--num-requests", str(requests), "--input-len",
                            str(input_len), "--output-len", str(output_len), *flags], ENV)
        print(f"bench {' '.join(flags[:10])}: {result}", flush=True)
        return result

    def row(name: str, config: dict, metric: str, value: float, unit: str, *baseline, higher_is_better=True) -> None:
        rows.append(((name, {**base, **config}, metric, value, unit, *baseline), higher_is_better))
        print(name, config, metric, value, unit, *baseline, flush=True)

    if "start" in parts:
        server = ServeProcess(config, port, os.path.join(logs, "serve_cold.log"))
        cold = server.wait_serving(1200)
        code, exit_s = server.terminate()
        print(f"cold start: SERVING after {cold:.1f} s; SIGTERM: exit {code} after {exit_s:.1f} s", flush=True)
        server = ServeProcess(config, port, os.path.join(logs, "serve_warm.log"))
        warm = server.wait_serving(600)
        code_warm, _ = server.terminate()
        print(f"warm start: SERVING after {warm:.1f} s; exit {code_warm}", flush=True)
        row("serve_start", {"cache": "empty"}, "time_to_serving_s", cold, "s", "goal", 90.0, higher_is_better=False)
        row("serve_start", {"cache": "filled"}, "time_to_serving_s", warm, "s", "the same start with an empty cache",
            cold, higher_is_better=False)
        row("serve_start", {"signal": "SIGTERM after SERVING, idle"}, "exit_code", code, "")
    if "load" in parts:
        import random

        rng = random.Random(0)
        from jaxserve.checkpoint.random_model import preset

        vocab = 49152 if args.model == "embedded" else preset(args.model).vocab_size
        prompts = [[rng.randrange(vocab - 1) for _ in range(args.input_len)] for _ in range(args.clients)]
        server = ServeProcess(config, port, os.path.join(logs, "serve_load.log"))
        start_s = server.wait_serving(1200)
        print(f"load server SERVING after {start_s:.1f} s", flush=True)
        grpc_load(server.address, prompts[:2], 4, 1)  # first-run effects
        over_grpc = grpc_load(server.address, prompts, args.output_len, args.client_processes)
        print(f"gRPC: {over_grpc}", flush=True)
        base_url = f"http://127.0.0.1:{http_port}/v1"
        grpc_load(base_url, prompts[:2], 4, 1, http_client_process)  # first-run effects
        rng_http = random.Random(1)  # other prompts: the prefix cache must not serve the gRPC run's
        http_prompts = [[rng_http.randrange(vocab - 1) for _ in range(args.input_len)] for _ in range(args.clients)]
        over_http = grpc_load(base_url, http_prompts, args.output_len, args.client_processes, http_client_process)
        code, exit_s = server.terminate()
        print(f"HTTP: {over_http}; exit {code} after {exit_s:.1f} s", flush=True)
        in_process = bench(args.clients, args.input_len, args.output_len)
        load = {"clients": args.clients, "input_len": args.input_len, "output_len": args.output_len,
                "client_processes": args.client_processes, "transport": "gRPC over loopback"}
        baseline = f"jaxserve bench --config (in-process engine), {args.clients} requests"
        row("serve_grpc_load", load, "output_tokens_per_s", over_grpc["output_tokens_per_s"], "tok/s", baseline,
            in_process["output_tokens_per_s"])
        for metric in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            row("serve_grpc_load", load, metric, over_grpc[metric], "s", baseline, in_process[metric],
                higher_is_better=False)
        http_load = {**load, "transport": "HTTP over loopback, the async openai client, streamed"}
        for metric in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            row("serve_http_load", http_load, metric, over_http[metric], "tok/s" if metric.endswith("per_s") else "s",
                "the same load over gRPC, same server and run", over_grpc[metric],
                higher_is_better=metric.endswith("per_s"))
    if "sampling" in parts:  # 64 rows decoding together (the config's max_slots)
        greedy = bench(64, 512, 256)
        flags = ["--temperature", "1.0", "--min-p", "0.05", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                 "--repetition-penalty", "1.1", *[x for t in range(0, 3000, 10) for x in ("--logit-bias", f"{t}=0.5")]]
        sampled = bench(64, 512, 256, flags)
        load = {"requests": 64, "input_len": 512, "output_len": 256, "sampling": " ".join(flags[:10]) +
                " and 300 logit_bias entries on every row"}
        row("sampling_decode", load, "itl_p50_s", sampled["itl_p50_s"], "s", "greedy rows, same run",
            greedy["itl_p50_s"], higher_is_better=False)
        row("sampling_decode", load, "output_tokens_per_s", sampled["output_tokens_per_s"], "tok/s",
            "greedy rows, same run", greedy["output_tokens_per_s"])
    if "structured" in parts:  # 64 JSON-schema rows against 64 free rows; masks need a tokenizer llguidance reads
        extra = ["--tokenizer", stdlib_bpe(work, preset_vocab(args.model))] if args.model != "embedded" else []
        pair = bench(64, 512, 256, (*extra, "--json-schema", os.path.join(REPO, "benchmarks", "data",
                                                                            "records_schema.json"), "--rounds", "3"))
        free, constrained = pair["unconstrained"], pair["constrained"]
        load = {"requests": 64, "input_len": 512, "output_len": 256, "schema": "benchmarks/data/records_schema.json"}
        row("structured_decode", load, "output_tokens_per_s", constrained["output_tokens_per_s"], "tok/s",
            "unconstrained rows, same engine, alternating rounds", free["output_tokens_per_s"])
        row("structured_decode", load, "mask_ms_per_step", constrained["mask_ms_per_step"], "ms", "the step's ITL p50",
            1e3 * constrained["itl_p50_s"], higher_is_better=False)
    for fields, higher_is_better in rows:
        print(json.dumps(record(args.out, *fields, higher_is_better=higher_is_better)), flush=True)


if __name__ == "__main__":
    main()
