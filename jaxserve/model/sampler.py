"""Per-row sampling: greedy, temperature, top-k and top-p, each row with its own parameters.

Randomness is keyed by (row seed, token index), so a request samples the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.engine.batch import NUM_TOP


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


def greedy(logits: jax.Array, *, one_pass: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Each row's most likely token (the first, on ties) and its log-probability.
    A row with a NaN logit gets a NaN log-probability (the engine ends its request) and token 0.

    On a GPU (`one_pass` None: by the default backend) one variadic reduction carries each row's running
    (max, its first index, sum of exp(x - max)), rescaling the sum when the max moves: one pass over the logits
    instead of three. Elsewhere three passes (max, first index of the max, log-sum-exp) that XLA:CPU vectorises;
    its variadic reductions do not (argmax's and a whole log-softmax took 4.4 ms at 32 rows of the embedded
    model's vocabulary, the three passes 2.5)."""
    if one_pass is None:
        one_pass = jax.default_backend() == "gpu"
    vocab = logits.shape[-1]
    if one_pass:
        x = logits.astype(jnp.float32)
        ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)

        def combine(a, b):
            (m1, i1, s1), (m2, i2, s2) = a, b
            first = (m1 > m2) | jnp.isnan(m1) | ((m1 == m2) & (i1 < i2))
            m = jnp.where(first, m1, m2)
            # (a sum whose max is the new one is kept as it is: exp(-inf - -inf) would be NaN)
            s = jnp.where(m1 == m, s1, s1 * jnp.exp(m1 - m)) + jnp.where(m2 == m, s2, s2 * jnp.exp(m2 - m))
            return m, jnp.where(first, i1, i2), s

        best, tokens, total = jax.lax.reduce((x, ids, jnp.ones_like(x)),
                                             (jnp.float32(-jnp.inf), jnp.int32(vocab), jnp.float32(0)),
                                             combine, (x.ndim - 1,))
        return jnp.where(jnp.isnan(best), 0, tokens), -jnp.log(total)
    best = jnp.max(logits, axis=-1, keepdims=True)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    tokens = jnp.min(jnp.where(logits == best, ids, vocab), axis=-1)
    tokens = jnp.where(tokens < vocab, tokens, 0)
    return tokens, -jnp.log(jnp.sum(jnp.exp(logits - best), axis=-1))


def sample_fn(logits: jax.Array, last_tokens: jax.Array, inp: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """A step's tokens drawn with each row's sampling parameters, and every row's top log-probabilities, from the
    step's logits -> (packed, last_tokens); replaces what `step_fn` returned for that step."""
    tokens = sample(logits, inp["seeds"], inp["steps"], inp["temperature"], inp["top_k"], inp["top_p"])
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, NUM_TOP)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return commit(chosen, tokens, last_tokens, inp["slots"], (top_ids, top_logprobs))


def commit(chosen: jax.Array, tokens: jax.Array, last_tokens: jax.Array, slots: jax.Array,
            top: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(packed [rows, 2 + 2 * NUM_TOP]: token, its log-probability `chosen`, top ids, top log-probabilities; each
    slot's last token, the next decode row's input, set to the row's token)."""
    top_ids, top_logprobs = top
    packed = jnp.concatenate([tokens[:, None].astype(jnp.float32), chosen[:, None], top_ids.astype(jnp.float32),
                              top_logprobs.astype(jnp.float32)], axis=-1)
    return packed, last_tokens.at[slots].set(tokens, mode="drop")
