"""Sampling rules on hand-made logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.sampler import sample

LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512, jnp.float32))


def draw(temperature=1.0, top_k=0, top_p=1.0, seeds=None, steps=0):
    b = LOGITS.shape[0]
    seeds = jnp.arange(b, dtype=jnp.uint32) if seeds is None else seeds
    return np.asarray(sample(LOGITS, seeds, jnp.full(b, steps, jnp.int32), jnp.full(b, temperature, jnp.float32),
                             jnp.full(b, top_k, jnp.int32), jnp.full(b, top_p, jnp.float32)))


def test_zero_temperature_is_argmax():
    assert (draw(temperature=0.0) == 0).all()


def test_top_k_limits_the_support():
    assert set(draw(top_k=2)) == {0, 1}
    assert (draw(top_k=1) == 0).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert set(draw(top_p=0.7)) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert (draw(top_p=0.4) == 0).all()


def test_frequencies_follow_the_distribution():
    counts = np.bincount(draw(), minlength=4) / LOGITS.shape[0]
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.08)
    assert set(draw()) == {0, 1, 2, 3}


def test_seed_and_step_make_draws_reproducible_and_distinct():
    same = jnp.full(LOGITS.shape[0], 7, jnp.uint32)
    assert (draw(seeds=same) == draw(seeds=same)).all()
    assert len(set(draw(seeds=same))) == 1  # one seed, one step: one key for every row
    assert not (draw(steps=0) == draw(steps=1)).all()


@pytest.mark.parametrize("one_pass", [False, True])
def test_greedy_step_takes_the_first_best_token_and_its_log_probability(one_pass):
    from jaxserve.model.sampler import greedy

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 1000)).astype(np.float32) * 4
    logits[1, [7, 500]] = 50.0  # a tie: the first index wins, as argmax's
    logits[2, 3] = np.nan
    logits[4, ::3] = -np.inf  # masked entries take no share
    tokens, chosen = (np.asarray(x) for x in greedy(jnp.asarray(logits), one_pass=one_pass))
    for row in (0, 1, 3, 4):
        assert tokens[row] == np.argmax(logits[row])
        x = logits[row].astype(np.float64)
        log_softmax = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
        assert abs(chosen[row] - log_softmax[tokens[row]]) < 1e-5
    assert tokens[1] == 7
    assert np.isnan(chosen[2]) and 0 <= tokens[2] < 1000  # the engine ends a request whose log-probability is NaN
