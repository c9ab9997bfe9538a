"""Named helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import LoadedModel
from jaxserve.config import EngineConfig, SamplingParams, ServerConfig, engine_config_for
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.transformer import ForwardOutput, forward
from jaxserve.runner import build_engine
from jaxserve.server.server import Server, model_info

# One engine config for the checks that only need some prompts' greedy tokens (and for tests/test_speculative.py):
# engines of one model and this config compile to the same programs, which the session's compilation cache
# (tests/conftest.py) then serves to every such check after the first. Sequences up to 256 tokens.
EMBEDDED_ENGINE = EngineConfig(max_slots=16, page_size=16, num_pages=256, max_pages_per_slot=16, chunk_buckets=(64,),
                               decode_row_buckets=(16,))
# One engine config for the modules that serve the embedded model a few requests at a time (gRPC, HTTP, sampling,
# lm-eval, tool calls, batch jobs): its steps too compile once for the session. Sequences up to 512 tokens (a tool
# template's prompts); decode steps of 1 and 4 rows (EMBEDDED_ENGINE's 16 would mostly compute padding here); one
# prefill chunk size, as each engine built loads and first-runs every step (about 0.8 s a step of this model).
# The CLI and server subprocesses read it as `engine: dataclasses.asdict(SERVING_ENGINE)` in their config files.
SERVING_ENGINE = EngineConfig(max_slots=4, page_size=16, num_pages=160, max_pages_per_slot=32, chunk_buckets=(32,))


def random_model(like: LoadedModel, seed: int, **shape: Any) -> LoadedModel:
    """A random 2-layer Llama (4 query heads, 2 KV heads of 16, unless `shape` says otherwise) with `like`'s
    vocabulary and tokenizer: for tests of what the engine or the server does, not of what a model says."""
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.weights import random_weights

    cfg = ModelConfig(**{"vocab_size": like.config.vocab_size, "hidden_size": 64, "intermediate_size": 96,
                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 256, **shape})
    return LoadedModel(cfg, random_weights(cfg, jax.random.key(seed)), like.tokenizer, "tiny")


def run_engine(model: LoadedModel, prompts: list[list[int]], params: SamplingParams, **engine_kw) -> list:
    """Generates every prompt through a freshly built engine; returns the finished requests."""
    engine = build_engine(model, engine_config_for([len(p) for p in prompts], params.max_tokens, **engine_kw))
    return engine.generate(prompts, [params] * len(prompts))


def greedy(model: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = build_engine(model, EMBEDDED_ENGINE)
    return [r.output_ids for r in engine.generate(prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts))]


def full_forward(model: LoadedModel, ids: list[int], *, return_hidden: bool = False) -> ForwardOutput:
    """One row through the model with a fresh paged cache laid out in order."""
    page_size = 16
    pages = -(-len(ids) // page_size)
    cache = KVCache.zeros(model.config, pages, page_size, jnp.float32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    return forward(model.weights, model.config, jnp.asarray([ids], jnp.int32), positions,
                   jnp.ones((1, len(ids)), bool), jnp.arange(pages, dtype=jnp.int32)[None], cache,
                   return_hidden=return_hidden)


def logits_of(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """The logits [len(ids), vocab] of one row. The row is padded at its end to a power of two (at least 64):
    attention is causal, so the padding changes no real position's logits, and the step-by-step references,
    which call this once per token, reuse a few compiled shapes instead of compiling one per length."""
    width = max(64, 1 << (len(ids) - 1).bit_length())
    return np.asarray(full_forward(model, ids + [0] * (width - len(ids))).logits[0, :len(ids)])


def wait_until(condition, timeout: float = 10.0, what: str = "condition", poll: float = 0.02) -> None:
    """Polls `condition` until it holds; fails the test naming `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
    """This process's environment for a child process on `devices` fake CPU devices. It keeps the suite's other XLA
    flags and its compilation cache (tests/conftest.py): a child given bare XLA_FLAGS compiled at full LLVM
    optimisation, and its programs missed the cache the suite's own processes fill."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), **extra}


@contextlib.contextmanager
def http_server(model: LoadedModel, engine_cfg: EngineConfig, **overrides: Any) -> Iterator[Server]:
    """A started engine and a server over it, HTTP on a free port, gRPC on another; `overrides` are ServerConfig
    fields. Stops both at the end."""
    engine = build_engine(model, engine_cfg)
    engine.start()
    cfg = ServerConfig(host="127.0.0.1", port=0, http_port=free_port(), metrics_port=None, engine=engine_cfg,
                       **overrides)
    server = Server(cfg, model_name=cfg.model_name)
    server.start()
    server.attach(engine, model_info(model, engine, cfg, dtype="float32"))
    try:
        yield server
    finally:
        server.stop()
        engine.stop()


def openai_client(server: Server) -> Any:
    """The `openai` SDK's client of a server's HTTP API."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0)
