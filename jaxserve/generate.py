"""Batched generation over a contiguous KV cache: a prefill step and a decode step, both jitted.

This is the foundation's generator: all prompts of a call run as one batch from start to end.
The engine (continuous batching over a paged cache) supersedes it for serving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import LoadedModel
from jaxserve.config import ModelConfig, SamplingParams
from jaxserve.errors import InputError
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.sampler import sample
from jaxserve.model.transformer import forward
from jaxserve.model.weights import Weights

_MIN_BUCKET = 16
_CACHE_ALIGN = 256


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_tokens)


@dataclass
class GenerationStats:
    prefill_s: float  # wall time until every row's first token was on the host
    decode_s: float
    decode_steps: int
    batch: int

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch * self.decode_steps / self.decode_s if self.decode_s else 0.0


def _bucket(n: int) -> int:
    return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


def _sampling_arrays(params: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
    return (np.array([p.seed for p in params], np.uint32),
            np.array([p.temperature for p in params], np.float32),
            np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32))


@partial(jax.jit, static_argnums=(1,), donate_argnums=(4,))
def _prefill(weights: Weights, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
             sampling: tuple[jax.Array, ...]) -> tuple[jax.Array, KVCache]:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    # Padding past a row's length writes junk K/V that decode overwrites before it is ever visible.
    out = forward(weights, cfg, tokens, positions, cache, logit_indices=lengths - 1)
    seeds, temperature, top_k, top_p = sampling
    steps = jnp.zeros_like(lengths)
    return sample(out.logits[:, 0], seeds, steps, temperature, top_k, top_p), out.cache


@partial(jax.jit, static_argnums=(1,), donate_argnums=(4,))
def _decode(weights: Weights, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache,
            steps: jax.Array, sampling: tuple[jax.Array, ...]) -> tuple[jax.Array, KVCache]:
    out = forward(weights, cfg, tokens[:, None], positions[:, None], cache)
    seeds, temperature, top_k, top_p = sampling
    return sample(out.logits[:, 0], seeds, steps, temperature, top_k, top_p), out.cache


class Generator:
    """Generates continuations for a batch of tokenized prompts."""

    def __init__(self, model: LoadedModel, *, cache_dtype: Any = None) -> None:
        self.model = model
        self.cfg = model.config
        self.cache_dtype = cache_dtype or jax.tree_util.tree_leaves(model.weights)[0].dtype
        self.last_stats: GenerationStats | None = None

    def stop_ids(self, params: SamplingParams) -> set[int]:
        eos = () if params.ignore_eos else self.model.tokenizer.eos_token_ids
        return set(eos) | set(params.stop_token_ids)

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raises InputError if the prompt cannot be served as asked."""
        context = self.cfg.max_position_embeddings
        if not prompt:
            raise InputError("the prompt is empty: it encodes to zero tokens")
        if len(prompt) + params.max_tokens > context:
            raise InputError(
                f"prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} exceeds the model's "
                f"context of {context} tokens; shorten the prompt or lower max_tokens"
            )
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[Completion]:
        """Runs all prompts as one batch until each hits a stop token or its max_tokens."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        for prompt, p in zip(prompts, params):
            self.check(prompt, p)
        batch = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        width = _bucket(int(lengths.max()))
        total = max(len(pr) + p.max_tokens for pr, p in zip(prompts, params))
        cache_len = min(-(-max(total, width) // _CACHE_ALIGN) * _CACHE_ALIGN, max(self.cfg.max_position_embeddings, width))
        tokens = np.zeros((batch, width), np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, :len(prompt)] = prompt
        sampling = _sampling_arrays(params)
        stops = [self.stop_ids(p) for p in params]
        outputs: list[list[int]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * batch

        start = time.perf_counter()
        cache = KVCache.zeros(self.cfg, batch, cache_len, self.cache_dtype)
        next_dev, cache = _prefill(self.model.weights, self.cfg, tokens, lengths, cache, sampling)
        step = 0
        prefill_s = decode_start = 0.0
        while True:
            # Dispatch the next step before reading this one's tokens, so the device never waits on us.
            positions = lengths + step
            following, cache = _decode(self.model.weights, self.cfg, next_dev, positions, cache,
                                       np.full(batch, step + 1, np.int32), sampling)
            current = np.asarray(next_dev)
            if step == 0:
                prefill_s = time.perf_counter() - start
                decode_start = time.perf_counter()
            for i in range(batch):
                if reasons[i] is not None:
                    continue
                outputs[i].append(int(current[i]))
                if int(current[i]) in stops[i]:
                    reasons[i] = "stop"
                elif len(outputs[i]) >= params[i].max_tokens:
                    reasons[i] = "length"
            if all(r is not None for r in reasons):
                break
            next_dev = following
            step += 1
        self.last_stats = GenerationStats(prefill_s, time.perf_counter() - decode_start, step, batch)
        return [Completion(list(pr), out, str(r)) for pr, out, r in zip(prompts, outputs, reasons)]
