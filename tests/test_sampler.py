"""The sampler against a numpy reference of vLLM's semantics, on the embedded model's teacher-forced logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.batch import StepInput
from jaxserve.model.sampler import SAMPLING_INPUTS, filtered, penalized, sample


@pytest.fixture(scope="module")
def logits(smollm):
    """Teacher-forced logits [8, vocab] of the embedded model: the last 8 positions of a sentence."""
    from tests.helpers import logits_of

    ids = smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun")
    return logits_of(smollm, ids)[-8:].astype(np.float32)


def reference(x: np.ndarray, counts: np.ndarray, in_prompt: np.ndarray, p: dict) -> tuple[np.ndarray, int]:
    """vLLM's sampling of one row, in numpy: (the probabilities it draws from, its greedy token)."""
    x = x.astype(np.float64).copy()
    for token, bias in p.get("logit_bias", {}).items():
        x[token] += bias
    seen = in_prompt | (counts > 0)
    rep = p.get("repetition", 1.0)
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    x -= p.get("frequency", 0.0) * counts + p.get("presence", 0.0) * (counts > 0)
    greedy_token = int(np.argmax(x))
    t = p.get("temperature", 1.0)
    probs = np.exp((x - x.max()) / t)
    probs /= probs.sum()
    probs[probs < p.get("min_p", 0.0) * probs.max()] = 0
    order = np.argsort(-probs, kind="stable")
    k = p.get("top_k", 0)
    if k:
        probs[order[k:]] = 0
    probs /= probs.sum()
    top_p = p.get("top_p", 1.0)
    before = np.cumsum(probs[order]) - probs[order]
    probs[order[(before >= top_p) & (np.arange(len(order)) > 0)]] = 0
    return probs / probs.sum(), greedy_token


def inputs(rows: list[dict], seeds=None, steps=None) -> dict:
    """The sampler's per-row arrays for parameter dicts (reference's keys)."""
    n = len(rows)
    inp = {name: np.asarray(x) for name, x in vars(StepInput.build([None] * n, 1, 1, n)).items()}
    inp["slots"] = np.arange(n, dtype=np.int32)
    inp["seeds"] = np.arange(n, dtype=np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
    inp["steps"] = np.zeros(n, np.int32) if steps is None else np.asarray(steps, np.int32)
    for i, p in enumerate(rows):
        for key in ("temperature", "top_k", "top_p", "min_p", "presence", "frequency", "repetition"):
            if key in p:
                inp[key][i] = p[key]
        bias = list(p.get("logit_bias", {}).items())
        if bias:
            inp["bias_ids"][i, :len(bias)], inp["bias"][i, :len(bias)] = zip(*bias, strict=True)
    return {name: jnp.asarray(inp[name]) for name in SAMPLING_INPUTS}


def history(vocab: int, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Output token counts and prompt tokens for each row, some tokens repeated."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((rows, vocab), np.int32)
    in_prompt = np.zeros((rows, vocab), bool)
    for r in range(rows):
        np.add.at(counts[r], rng.integers(0, 200, 12), 1)
        in_prompt[r, rng.integers(0, 200, 20)] = True
    return counts, in_prompt


CASES = {
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.6},
    "min_p": {"min_p": 0.05},
    "presence": {"presence": 1.5},
    "frequency": {"frequency": 0.8},
    "repetition": {"repetition": 1.3},
    "negative_penalties": {"presence": -0.5, "frequency": -0.3, "repetition": 0.8},
    "logit_bias": {"logit_bias": {11: 8.0, 42: -100.0, 3000: 5.5}},
    "everything": {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "presence": 0.4, "frequency": 0.3,
                   "repetition": 1.2, "logit_bias": {7: 3.0, 19: -2.0}},
}


@pytest.mark.parametrize("case", CASES)
def test_filtered_distribution_and_greedy_token_match_the_reference(logits, case):
    p = CASES[case]
    rows = len(logits)
    counts, in_prompt = history(logits.shape[1], rows)
    inp = inputs([p] * rows)
    x = penalized(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(in_prompt), inp)
    sort = "top_k" in p or "top_p" in p
    probs = np.asarray(jax_softmax(filtered(x, {**inp, "temperature": jnp.full(rows, p.get("temperature", 1.0))},
                                            sort=sort)))
    greedy_tokens = np.asarray(sample(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(in_prompt),
                                      {**inp, "temperature": jnp.zeros(rows)}, sort=sort))
    drawn = np.asarray(sample(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(in_prompt),
                              {**inp, "temperature": jnp.full(rows, p.get("temperature", 1.0))}, sort=sort))
    for r in range(rows):
        ref_probs, ref_greedy = reference(logits[r], counts[r], in_prompt[r], p)
        np.testing.assert_allclose(probs[r], ref_probs, atol=2e-6, err_msg=f"row {r}")
        assert greedy_tokens[r] == ref_greedy
        assert ref_probs[drawn[r]] > 0, f"row {r} drew token {drawn[r]}, outside the reference's support"


def jax_softmax(x):
    import jax

    return jax.nn.softmax(x, axis=-1)


def test_rows_with_different_parameters_sample_what_each_samples_alone(logits):
    cases = list(CASES.values())[:len(logits)]
    counts, in_prompt = history(logits.shape[1], len(cases))
    together = sample(jnp.asarray(logits[:len(cases)]), jnp.asarray(counts), jnp.asarray(in_prompt),
                      inputs(cases, seeds=range(len(cases)), steps=[3] * len(cases)), sort=True)
    for r, p in enumerate(cases):
        alone = sample(jnp.asarray(logits[r:r + 1]), jnp.asarray(counts[r:r + 1]), jnp.asarray(in_prompt[r:r + 1]),
                       inputs([p], seeds=[r], steps=[3]), sort="top_k" in p or "top_p" in p)
        assert int(together[r]) == int(alone[0]), f"row {r} ({p})"


def test_draws_follow_the_distribution_and_are_keyed_by_seed_and_step():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    rows = 2048
    x = jnp.asarray(np.log(np.tile(probs, (rows, 1))))
    zeros = jnp.zeros((rows, 4), jnp.int32), jnp.zeros((rows, 4), bool)

    def draw(seeds, step=0, **p):
        return np.asarray(sample(x, *zeros, inputs([{"temperature": 1.0, **p}] * rows, seeds=seeds,
                                                   steps=[step] * rows), sort=bool(p)))

    spread = draw(range(rows))
    np.testing.assert_allclose(np.bincount(spread, minlength=4) / rows, probs, atol=0.04)
    assert set(draw(range(rows), top_k=2)) == {0, 1}
    assert set(draw(range(rows), top_p=0.7)) == {0, 1}
    same = [7] * rows
    assert len(set(draw(same))) == 1 and (draw(same) == draw(same)).all()
    assert not (draw(range(rows), step=0) == draw(range(rows), step=1)).all()


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
