"""Perplexity of a model over a text, in sliding windows over the context.

Each window is one forward of up to `context` tokens from a fresh cache; it scores only the tokens
that no earlier window scored, so with `stride < context` every scored token (after the first
window) sees at least `context - stride` tokens of context. All windows have one shape (the last
is padded), so the forward compiles once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import LoadedModel
from jaxserve.errors import InputError
from jaxserve.model.kv_cache import KVCache, page_dtype
from jaxserve.model.transformer import forward

PAGE_SIZE = 16


def window_spans(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) of each window: tokens [begin, end) go in, and the predictions of
    tokens [first_scored, end) count (a window's first token has no context in it: it is never scored)."""
    spans, scored_to = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        spans.append((begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return spans


def perplexity(model: LoadedModel, token_ids: list[int], *, context: int = 1024, stride: int = 512,
               attention: str = "auto", kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """exp(mean negative log-likelihood) of every token after the first, and how many were scored.
    `kv_cache_dtype` as the engine's (EngineConfig): float8_e4m3fn measures what 8-bit K/V pages cost."""
    if context < 2 or not 0 < stride <= context:
        raise InputError(f"need context >= 2 and 0 < stride <= context, got context={context} stride={stride}")
    if context > model.config.max_position_embeddings:
        raise InputError(f"context={context} exceeds the model's {model.config.max_position_embeddings} positions")
    if len(token_ids) < 2:
        raise InputError(f"the text has {len(token_ids)} tokens; perplexity needs at least 2")
    width = -(-min(context, len(token_ids)) // PAGE_SIZE) * PAGE_SIZE
    pages = width // PAGE_SIZE
    dtype = page_dtype(kv_cache_dtype, model.weights.final_norm.dtype)

    @jax.jit
    def window_nll(weights: Any, tokens: jax.Array, length: jax.Array) -> jax.Array:
        # tokens [1, width], the first `length` real: -log p(tokens[i + 1] | tokens[:i + 1]) for each i
        cache = KVCache.zeros(model.config, pages, PAGE_SIZE, dtype)
        positions = jnp.arange(width, dtype=jnp.int32)[None]
        valid = positions < length
        out = forward(weights, model.config, tokens, positions, valid, jnp.arange(pages, dtype=jnp.int32)[None], cache,
                      attention=attention)
        logp = jax.nn.log_softmax(out.logits[0, :-1], axis=-1)
        return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]

    ids = np.asarray(token_ids, np.int32)
    total, count = 0.0, 0
    for begin, end, first in window_spans(len(ids), width, min(stride, width)):
        chunk = np.zeros((1, width), np.int32)
        chunk[0, : end - begin] = ids[begin:end]
        nll = np.asarray(window_nll(model.weights, jnp.asarray(chunk), jnp.int32(end - begin)), np.float64)
        scored = nll[first - 1 - begin: end - 1 - begin]  # nll[i] predicts token begin + i + 1
        total += float(scored.sum())
        count += len(scored)
    return {"perplexity": math.exp(total / count), "tokens": count, "nll": total / count, "context": width,
            "stride": min(stride, width)}
