"""Per-row sampling: greedy, temperature, top-k and top-p, each row with its own parameters.

Randomness is keyed by (row seed, token index), so a request samples the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,  # [b, vocab] float32
    seeds: jax.Array,  # [b] uint32
    steps: jax.Array,  # [b] int32: index of the token being sampled, mixed into the key
    temperature: jax.Array,  # [b] float32; 0 means greedy
    top_k: jax.Array,  # [b] int32; 0 means no limit
    top_p: jax.Array,  # [b] float32; 1 means no limit
) -> jax.Array:  # [b] int32
    """Draws one token per row (greedy where the temperature is 0). Every row pays the vocabulary sort: the
    engine calls this only for steps where some row samples (jaxserve.step), deciding on the host."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, _draw(logits, seeds, steps, temperature, top_k, top_p), greedy)


def _draw(logits: jax.Array, seeds: jax.Array, steps: jax.Array, temperature: jax.Array, top_k: jax.Array,
          top_p: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, vocab)  # descending
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
