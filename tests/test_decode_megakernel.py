"""The decode megakernel's reference (pallas_kernels.decode_megakernel.reference) against the model's own decode step:
the same logits and the same K/V written, from weights and pages stacked across the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig, QuantConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.quant import embed_lookup, quantize_weights
from jaxserve.model.transformer import forward, normed_linear, rope_inv_freq
from jaxserve.model.weights import random_weights
from pallas_kernels.decode_megakernel.reference import decode_layers, stack_layers, stack_pages

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
PAGE = 4


def _model():
    weights = random_weights(CFG, jax.random.PRNGKey(0))
    layers = tuple(layer.__class__(**{**layer.__dict__,  # random norm gains, so a gain left out shows
                                      "attn_norm": 1 + 0.3 * jax.random.normal(jax.random.PRNGKey(i), (CFG.hidden_size,)),
                                      "mlp_norm": 1 - 0.3 * jax.random.normal(jax.random.PRNGKey(9 + i),
                                                                              (CFG.hidden_size,))})
                   for i, layer in enumerate(weights.layers))
    return quantize_weights(weights.__class__(weights.embed, layers, weights.final_norm, weights.lm_head),
                            QuantConfig(mode="int8"))


def test_reference_decode_step_is_the_models():
    """Two rows with their pages in shuffled order, prompts of 5 and 9 tokens (the second crossing pages); then one
    decode step by the model and by the reference on stacked weights and pages: logits and written K/V agree."""
    weights = _model()
    table = np.array([[5, 1, 7, 0], [2, 6, 3, 4]], np.int32)
    cache = KVCache.zeros(CFG, 8, PAGE, jnp.float32)
    lengths = np.array([5, 9], np.int32)
    prompt = np.array(jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, CFG.vocab_size), np.int32)
    positions = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    cache = forward(weights, CFG, jnp.asarray(prompt), jnp.asarray(positions), jnp.asarray(positions < lengths[:, None]),
                    jnp.asarray(table), cache).cache
    token = jnp.asarray([[11], [42]], jnp.int32)
    stacked_k, stacked_v = stack_pages(cache.k), stack_pages(cache.v)  # before the step: the model's writes are next
    out = forward(weights, CFG, token, jnp.asarray(lengths)[:, None], jnp.ones((2, 1), bool), jnp.asarray(table), cache)

    st = stack_layers(CFG, weights.layers)
    x = embed_lookup(weights.embed, token, jnp.float32)[:, 0]
    h, k_pages, v_pages = decode_layers(CFG, st, x, stacked_k, stacked_v, jnp.asarray(table), jnp.asarray(lengths),
                                        rope_inv_freq(CFG.head_dim, CFG.rope_theta, CFG.rope_scaling), PAGE)
    logits = normed_linear(h, weights.final_norm, weights.lm_head, CFG.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(out.logits[:, 0]), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(k_pages), np.asarray(stack_pages(out.cache.k)), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(v_pages), np.asarray(stack_pages(out.cache.v)), rtol=2e-4, atol=2e-4)
    assert not np.allclose(np.asarray(k_pages), np.asarray(stacked_k))  # the step wrote something


def test_stack_layers_refuses_what_the_megakernel_does_not_take():
    weights = _model()
    with pytest.raises(ValueError, match="intermediate_size=96 is not a multiple of 128"):
        stack_layers(ModelConfig(**{**CFG.__dict__, "intermediate_size": 96}), weights.layers)
    grouped = quantize_weights(random_weights(CFG, jax.random.PRNGKey(0)), QuantConfig(mode="int8", group_size=32))
    with pytest.raises(ValueError, match="layer 0's wqkv must be int8 with one scale a channel.*group_size 32"):
        stack_layers(CFG, grouped.layers)
    with pytest.raises(ValueError, match="layer 0's wqkv must be int8 .* got Array"):
        stack_layers(CFG, random_weights(CFG, jax.random.PRNGKey(0)).layers)
