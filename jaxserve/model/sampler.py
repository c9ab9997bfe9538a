"""Per-row sampling with vLLM's semantics, each row with its own parameters, batched on the device.

A row's logits pass, in vLLM's order: its logit biases (which also carry min_tokens' suppression of the stop
tokens, as -inf), then the repetition, frequency and presence penalties, then the greedy choice for rows at
temperature 0, else temperature, min-p, top-k and top-p, and a draw. Returned log-probabilities are the model's
own (vLLM's default "raw" log-probabilities), before any of that.

Randomness is keyed by (row seed, token index), so a request samples the same tokens whatever else shares its
batch. Every parameter is an array with a row each, so no mix of settings recompiles; the one choice made at
compile time is whether the step pays a vocabulary sort (`sort`: some row has top-k or top-p), which the host
knows when it builds the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.engine.batch import NUM_TOP

# The per-row arrays `sample_fn` reads, beside the logits and the device's token counts (see jaxserve.step).
SAMPLING_INPUTS = ("slots", "seeds", "steps", "temperature", "top_k", "top_p", "min_p", "presence", "frequency",
                   "repetition", "bias_ids", "bias")


def penalized(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, inp: dict[str, jax.Array]) -> jax.Array:
    """The logits [b, vocab] after each row's logit biases and penalties, vLLM's `apply_penalties`:
    repetition divides a positive logit (multiplies a negative one) of every token seen in the prompt or the output;
    frequency subtracts penalty × the token's count in the output; presence subtracts penalty once it occurs.
    counts [b, vocab] int32 are the output's token counts, in_prompt [b, vocab] bool the prompt's tokens."""
    x = biased(logits, inp)
    seen = in_prompt | (counts > 0)
    repetition = inp["repetition"][:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / repetition, x * repetition), x)
    return x - inp["frequency"][:, None] * counts - inp["presence"][:, None] * (counts > 0)


def biased(logits: jax.Array, inp: dict[str, jax.Array]) -> jax.Array:
    """The logits [b, vocab] with each row's logit biases added (ids past the vocabulary are unused entries)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, inp["bias_ids"]].add(inp["bias"], mode="drop")


def filtered(x: jax.Array, inp: dict[str, jax.Array], *, sort: bool) -> jax.Array:
    """Scaled logits [b, vocab] of the rows' sampling distributions: temperature, then min-p (tokens below min_p ×
    the top probability dropped), then, with `sort`, top-k and top-p (the smallest set of most likely tokens whose
    mass reaches top_p). Dropped tokens are -inf. Rows at temperature 0 are left at temperature 1 (greedy takes
    the argmax before this)."""
    temperature = inp["temperature"]
    x = x / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    best = jnp.max(x, axis=-1, keepdims=True)
    # p >= min_p · p_max  <=>  x - x_max >= log(min_p); min_p 0 keeps everything (log 0 = -inf)
    x = jnp.where(x - best >= jnp.log(inp["min_p"])[:, None], x, -jnp.inf)
    if not sort:
        return x
    vocab = x.shape[-1]
    sorted_x, order = jax.lax.top_k(x, vocab)  # descending
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(inp["top_k"] > 0, inp["top_k"], vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_x, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep &= (before < inp["top_p"][:, None]) | (rank == 0)
    kept = jnp.where(keep, sorted_x, -jnp.inf)
    return jnp.full_like(x, -jnp.inf).at[jnp.arange(x.shape[0])[:, None], order].set(kept)


def sample(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, inp: dict[str, jax.Array], *,
           sort: bool) -> jax.Array:
    """One token per row [b] int32: the argmax of the penalized logits at temperature 0, else a draw from
    `filtered`'s distribution."""
    x = penalized(logits, counts, in_prompt, inp)
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(inp["seeds"], inp["steps"])
    drawn = jax.vmap(jax.random.categorical)(keys, filtered(x, inp, sort=sort)).astype(jnp.int32)
    return jnp.where(inp["temperature"] > 0, drawn, greedy_tokens)


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


def sample_fn(logits: jax.Array, last_tokens: jax.Array, counts: jax.Array, in_prompt: jax.Array,
              inp: dict[str, jax.Array], allowed: jax.Array | None = None, *, sort: bool,
              top: bool) -> tuple[jax.Array, jax.Array]:
    """A step's tokens drawn with each row's parameters from the step's logits -> (packed, last_tokens); replaces
    what `step_fn` returned for that step. counts and in_prompt are the device's per-slot arrays (jaxserve.step's
    DeviceState), read at the rows' slots. With `top`, every row's NUM_TOP most likely tokens come too. With
    `allowed` (`only_allowed`'s masks), each row draws from its allowed tokens only; the log-probabilities returned
    stay the model's own."""
    slots = jnp.minimum(inp["slots"], counts.shape[0] - 1)  # (padding rows read some slot; their token is dropped)
    drawn_from = logits if allowed is None else only_allowed(logits, allowed)
    tokens = sample(drawn_from, counts[slots], in_prompt[slots], inp, sort=sort)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    rows = logits.shape[0]
    if top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, NUM_TOP)
    else:
        top_ids, top_logprobs = jnp.zeros((rows, NUM_TOP), jnp.int32), jnp.zeros((rows, NUM_TOP), jnp.float32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return commit(chosen, tokens, last_tokens, inp["slots"], (top_ids, top_logprobs))


def masked_greedy_fn(logits: jax.Array, last_tokens: jax.Array, slots: jax.Array, allowed: jax.Array,
                     unmasked: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sample_fn` with masks for a step whose rows are all greedy without top log-probabilities (the host knows:
    StepInput.samples is false): each row's most likely allowed token, and its log-probability under the model's
    own distribution -> (packed, last_tokens). `unmasked` is the step's own packed result (its greedy token and
    that token's log-probability give each row's log-sum-exp without another pass). No draw or sort to pay for."""
    tokens, _ = greedy(only_allowed(logits, allowed))
    rows = jnp.arange(logits.shape[0])
    lse = logits[rows, unmasked[:, 0].astype(jnp.int32)] - unmasked[:, 1]
    chosen = logits[rows, tokens] - lse
    none = (jnp.zeros((len(rows), NUM_TOP), jnp.int32), jnp.zeros((len(rows), NUM_TOP), jnp.float32))
    return commit(chosen, tokens, last_tokens, slots, none)


def only_allowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """The logits [b, vocab] with every token a row's mask does not allow at -inf. allowed [b, ceil(vocab / 32)]
    int32: bit t % 32 of word t // 32 allows token t (jaxserve.engine.grammar's layout; a free row sets every bit)."""
    b, vocab = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # (arithmetic shift: bit 31 is kept by & 1)
    return jnp.where(bits.reshape(b, -1)[:, :vocab] != 0, logits, -jnp.inf)


def commit(chosen: jax.Array, tokens: jax.Array, last_tokens: jax.Array, slots: jax.Array,
           top: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(packed [rows, 2 + 2 * NUM_TOP]: token, its log-probability `chosen`, top ids, top log-probabilities; each
    slot's last token, the next decode row's input, set to the row's token)."""
    top_ids, top_logprobs = top
    packed = jnp.concatenate([tokens[:, None].astype(jnp.float32), chosen[:, None], top_ids.astype(jnp.float32),
                              top_logprobs.astype(jnp.float32)], axis=-1)
    return packed, last_tokens.at[slots].set(tokens, mode="drop")


def prompt_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Log-probabilities of prompt tokens from the logits [n, vocab] of the positions before them: targets [n]
    (-1 where there is none) -> [n, 1 + 2 * NUM_TOP] float32: the target's log-probability, the NUM_TOP most likely
    ids (as float) and their log-probabilities."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, NUM_TOP)
    target = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)
    return jnp.concatenate([target, top_ids.astype(jnp.float32), top_logprobs], axis=-1)


def verify_fn(logits: jax.Array, last_tokens: jax.Array, inp: dict[str, jax.Array], *, sort: bool,
              top: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative verification: each row's input tokens are its last token and then its drafts (inp["tokens"]
    [b, w], the drafts where inp["valid"]); logits [b, w, vocab] are the target's at those positions. A greedy row
    accepts the longest prefix of drafts equal to the target's argmax, then takes the argmax after it. A sampled
    row accepts draft i with probability p_i(draft i) (the target's distribution at i; the proposal is
    deterministic), and at the first rejection draws from p_i without that token; with every draft accepted it
    draws from the next position's distribution (Leviathan et al., Chen et al.): its tokens are distributed as the
    target's. Rows with penalties do not speculate (their counts would need the drafts), logit biases apply.
    -> (packed [b, w, 2 + 2 * NUM_TOP]: each emitted token, its log-probability and top alternatives, as `commit`
    packs them; counts [b]: tokens emitted, accepted drafts + 1; last_tokens with each row's last emitted)."""
    b, w, vocab = logits.shape

    def per_position(x: jax.Array) -> jax.Array:
        return jnp.repeat(x, w, axis=0)

    flat = {name: per_position(inp[name]) for name in SAMPLING_INPUTS if name != "steps"}
    flat["steps"] = (inp["steps"][:, None] + jnp.arange(w)[None, :]).reshape(-1)
    x = biased(logits.reshape(b * w, vocab), flat)
    target = jnp.argmax(x, axis=-1).astype(jnp.int32).reshape(b, w)
    scaled = filtered(x, flat, sort=sort)
    probs = jax.nn.softmax(scaled, axis=-1).reshape(b, w, vocab)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(flat["seeds"], flat["steps"])
    drafts = inp["tokens"][:, 1:]
    proposed = inp["valid"][:, 1:]
    draft_p = jnp.take_along_axis(probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys).reshape(b, w)[:, :-1]
    sampled = inp["temperature"] > 0
    accept = jnp.where(sampled[:, None], uniform < draft_p, drafts == target[:, :-1]) & proposed
    accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)  # the leading accepted drafts
    at = jnp.arange(b)
    rejected = accepted < jnp.sum(proposed, axis=1)
    # the last token, drawn at position `accepted`: without the rejected draft there, from p as it is past them all
    last_x = scaled.reshape(b, w, vocab)[at, accepted]
    rejected_draft = drafts[at, jnp.minimum(accepted, w - 2)]
    last_x = jnp.where(rejected[:, None] & (jnp.arange(vocab)[None, :] == rejected_draft[:, None]), -jnp.inf, last_x)
    last_keys = keys.reshape(b, w)[at, accepted]
    drawn = jax.vmap(lambda k, z: jax.random.categorical(jax.random.fold_in(k, 2), z))(last_keys, last_x)
    final = jnp.where(sampled, drawn.astype(jnp.int32), target[at, accepted])
    position = jnp.arange(w)[None, :]
    emitted = jnp.where(position < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                        jnp.where(position == accepted[:, None], final[:, None], 0))
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, emitted[..., None], axis=-1)[..., 0]
    if top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, NUM_TOP)
    else:
        top_ids, top_logprobs = jnp.zeros((b, w, NUM_TOP), jnp.int32), jnp.zeros((b, w, NUM_TOP), jnp.float32)
    packed = jnp.concatenate([emitted[..., None].astype(jnp.float32), chosen[..., None], top_ids.astype(jnp.float32),
                              top_logprobs], axis=-1)
    return packed, accepted + 1, last_tokens.at[inp["slots"]].set(final, mode="drop")
