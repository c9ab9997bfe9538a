"""The jit boundary: one step function, compiled ahead of time for a fixed list of shape buckets.

Buckets are (rows, width, pages): (r, 1, p) for decode over the first r slots, for each r in
`decode_buckets`, with page tables p pages wide (`decode_page_widths`), and (r, c, max pages) for
prefill chunks of width c from r requests (`prefill_buckets`).
All are compiled at start; a step of any other shape raises instead of compiling. The KV cache
is donated, so XLA updates its pages in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import LoadedModel
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.batch import NUM_TOP, StepInput, StepOutput
from jaxserve.engine.engine import Engine
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.sampler import sample
from jaxserve.model.transformer import forward
from jaxserve.model.weights import Weights

log = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = 0


def _count_compilation(event: str, duration: float, **_: Any) -> None:
    global _compilations
    if event == _BACKEND_COMPILE_EVENT:
        _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilation)


def compilation_count() -> int:
    """XLA backend compilations in this process so far (every jit, not only the step's)."""
    return _compilations


class DeviceState(NamedTuple):
    """What the device keeps between steps; donated to every step."""

    cache: KVCache
    last_tokens: jax.Array  # [max_slots] int32: each slot's latest sample, the next decode row's input


def step_fn(weights: Weights, state: DeviceState, inp: dict[str, jax.Array], *,
            cfg: ModelConfig, attention: str = "auto") -> tuple[jax.Array, DeviceState]:
    """One forward over a bucket plus sampling; returns one packed array [rows, 2 + 2 * NUM_TOP]."""
    fed = state.last_tokens[jnp.minimum(inp["slots"], state.last_tokens.shape[0] - 1)]
    first = jnp.where(inp["feed"], fed, inp["tokens"][:, 0])
    tokens_in = inp["tokens"].at[:, 0].set(first)
    out = forward(weights, cfg, tokens_in, inp["positions"], inp["valid"], inp["page_table"], state.cache,
                  logit_indices=inp["last"], attention=attention)
    logits = out.logits[:, 0]
    tokens = sample(logits, inp["seeds"], inp["steps"], inp["temperature"], inp["top_k"], inp["top_p"])
    last_tokens = state.last_tokens.at[inp["slots"]].set(tokens, mode="drop")
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    top_logprobs, top_ids = jax.lax.cond(  # the sort is skipped when no row asks for alternatives
        jnp.any(inp["want_top"]), lambda: tuple(jax.lax.top_k(logprobs, NUM_TOP)),
        lambda: (jnp.zeros((logits.shape[0], NUM_TOP), logprobs.dtype), jnp.zeros((logits.shape[0], NUM_TOP), jnp.int32)))
    packed = jnp.concatenate([tokens[:, None].astype(jnp.float32), chosen, top_ids.astype(jnp.float32), top_logprobs],
                             axis=-1)
    return packed, DeviceState(out.cache, last_tokens)


class StepRunner:
    """Owns the device state (weights, KV pages) and the compiled steps."""

    def __init__(self, model: LoadedModel, cfg: EngineConfig, *, cache_dtype: Any = None) -> None:
        self.model_cfg = model.config
        self.cfg = cfg
        self.weights = model.weights
        dtype = cache_dtype or model.weights.final_norm.dtype  # the activations' dtype (some weights may be int8)
        if cfg.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self.state = DeviceState(KVCache.zeros(model.config, cfg.num_pages, cfg.page_size, dtype),
                                 jnp.zeros(cfg.max_slots, jnp.int32))
        full = cfg.max_pages_per_slot
        self.buckets = sorted({(r, 1, p) for r in cfg.decode_buckets for p in cfg.decode_page_widths}
                              | {(r, c, full) for r, c in cfg.prefill_buckets})
        self._compiled: dict[tuple[int, int, int], Any] = {}
        jitted = jax.jit(lambda w, c, i: step_fn(w, c, i, cfg=model.config, attention=cfg.attention), donate_argnums=(1,))
        start = time.perf_counter()
        for bucket in self.buckets:
            example = StepInput.build([None] * bucket[0], bucket[1], bucket[2], cfg.max_slots)
            self._compiled[bucket] = jitted.lower(self.weights, self.state, vars(example)).compile()
        log.info("compiled %d step buckets in %.1f s", len(self.buckets), time.perf_counter() - start)

    def dispatch(self, inp: StepInput) -> Callable[[], StepOutput]:
        """Enqueues a step on the device and returns at once; calling the result waits and copies it back."""
        compiled = self._compiled.get(inp.shape)
        if compiled is None:
            raise RuntimeError(f"step shape {inp.shape} is not one of the compiled buckets {self.buckets}")
        packed, self.state = compiled(self.weights, self.state, vars(inp))
        return lambda: StepOutput.unpack(np.asarray(packed))


def build_engine(model: LoadedModel, cfg: EngineConfig) -> Engine:
    """Compiles every bucket for `model` and returns an engine ready to take requests."""
    return Engine(StepRunner(model, cfg), model.tokenizer, cfg, vocab_size=model.config.vocab_size,
                  context_len=model.config.max_position_embeddings)


def engine_config_for(prompt_lens: list[int], max_tokens: int, *, page_size: int = 16, max_slots: int = 16,
                      chunk_sizes: tuple[int, ...] = (16, 64, 256), attention: str = "auto") -> EngineConfig:
    """An engine just big enough for a known set of prompts (CLI generate, benchmarks, tests)."""
    longest = max(prompt_lens) + max_tokens
    pages_per_slot = -(-longest // page_size)
    slots = max(1, min(len(prompt_lens), max_slots))
    needed = max(prompt_lens)
    buckets = tuple(c for c in chunk_sizes if c < needed) + (next((c for c in chunk_sizes if c >= needed), chunk_sizes[-1]),)
    return EngineConfig(max_slots=slots, page_size=page_size, num_pages=slots * pages_per_slot,
                        max_pages_per_slot=pages_per_slot, chunk_buckets=buckets, attention=attention)
