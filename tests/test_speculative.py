"""Speculative decoding on the embedded model: lossless against plain decoding, inside continuous batching."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.config import SamplingParams, SpeculativeConfig
from jaxserve.engine.batch import StepInput
from jaxserve.engine.speculative import ngram_proposal
from jaxserve.model.sampler import SAMPLING_INPUTS, verify_fn
from tests.helpers import EMBEDDED_ENGINE

# one decode row count and one chunk width: few steps to compile for each of the module's engines, the plain one
# shared with other modules' greedy checks
ENGINE = EMBEDDED_ENGINE
NGRAM = SpeculativeConfig(method="ngram", num_tokens=4)
PASSAGES = ["The quick brown fox jumps over the lazy dog, and the dog sleeps in the warm afternoon sun.",
            "Water boils at one hundred degrees Celsius at sea level, and it freezes at zero degrees.",
            "Paris is the capital of France; Berlin is the capital of Germany; Rome is the capital of Italy."]


@pytest.fixture(scope="module")
def engines(smollm):
    from jaxserve.runner import build_engine

    return build_engine(smollm, ENGINE), build_engine(smollm, dataclasses.replace(ENGINE, speculative=NGRAM))


@pytest.fixture(scope="module")
def prompts(smollm):
    """32 prompts, two for each of the 16 slots: most ask to repeat or edit a passage they hold (n-gram lookup finds
    the answer in them), some are open questions."""
    tok = smollm.tokenizer
    asks = ["Repeat this text exactly: {}", "Copy the following sentence: {}", "Say it again: {}",
            "What does this say? {}", "Write a short poem about {}"]
    out = []
    for i in range(32):
        text = asks[i % len(asks)].format(PASSAGES[i % len(PASSAGES)] if i % len(asks) < 4 else "winter number {i}")
        # (a system message of its own: the template's default one would be most of each prompt's tokens)
        out.append(tok.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]))
    return out


def load_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10 + i % 5) for i in range(n)]


@pytest.fixture(scope="module")
def greedy_load(engines, prompts):
    """The greedy tokens without speculation of the first 16 prompts, one for each slot, once for the checks on the
    embedded model: (prompts, params, tokens). (All 32, each slot taken twice, run on the small random model.)"""
    prompts = prompts[:ENGINE.max_slots]
    params = load_params(len(prompts))
    return prompts, params, [r.output_ids for r in engines[0].generate(prompts, params)]


def test_ngram_proposal_takes_what_followed_the_latest_match():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, 1, 3) == [7, 8, 1]
    assert ngram_proposal([5, 6, 5, 6], 4, 1, 2) == [5, 6]  # (the match's own continuation, to the end)
    assert ngram_proposal([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_proposal([4, 1, 4], 2, 2, 3) == []  # no 2-gram repeats


def test_greedy_tokens_are_identical_with_ngram_speculation(engines, greedy_load):
    spec = engines[1]
    prompts, params, want = greedy_load
    before = dataclasses.replace(spec.spec)
    got = spec.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert [len(r.output_ids) for r in got] == [len(w) for w in want]  # max_tokens exact where it ends them
    accepted = spec.spec.num_accepted_tokens - before.num_accepted_tokens
    assert accepted > 0.2 * sum(len(w) for w in want), spec.spec  # the repeats are found in the prompts
    pages = spec.scheduler.pages
    assert pages.num_available == pages.num_pages and not spec.scheduler.running  # every page back in the pool


def test_a_stop_string_inside_an_accepted_run_cuts_where_it_does_without_speculation(engines, prompts, smollm):
    plain, spec = engines
    prompt = prompts[0]
    free = plain.generate([prompt], [SamplingParams(max_tokens=30)])[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]  # three characters in the middle of a repeat
    params = SamplingParams(max_tokens=30, stop=(stop,))
    want = plain.generate([prompt], [params])[0]
    before = spec.spec.num_accepted_tokens
    got = spec.generate([prompt], [params])[0]
    assert spec.spec.num_accepted_tokens > before
    assert (got.text, got.output_ids, got.finish_reason) == (want.text, want.output_ids, want.finish_reason)
    assert got.finish_reason == "stop" and stop not in got.text


def test_requests_that_do_not_speculate_batch_with_those_that_do(engines, prompts):
    plain, spec = engines
    params = [SamplingParams(max_tokens=20, speculate=i % 2 == 0) for i in range(8)]
    params += [SamplingParams(max_tokens=20, repetition_penalty=1.3), SamplingParams(max_tokens=20, logprobs=2)]
    got = spec.generate(prompts[:10], params)
    want = plain.generate(prompts[:10], params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for g, w in zip(got[-1:], want[-1:]):  # logprobs through verify steps equal the plain steps'
        np.testing.assert_allclose([lp for lp, _ in g.logprobs], [lp for lp, _ in w.logprobs], atol=1e-4)


def test_sampled_tokens_keep_the_target_distribution(smollm):
    """Rejection sampling over many seeds: the first and the second token of a verify row are distributed as the
    target's distribution at their positions (chi-square), whatever the drafts."""
    from tests.helpers import logits_of

    ids = smollm.tokenizer.encode("The capital of France is")
    full = logits_of(smollm, ids + [12, 13])[-3:]  # the target at the last token and two drafted positions
    vocab = 12
    top = np.argsort(-full[0])[:vocab]
    logits = np.stack([full[i][top] for i in range(3)]).astype(np.float32)  # a small vocabulary: the 12 likeliest
    rows = 20000
    drafts = [1, 0]  # the second likeliest, then the likeliest: some rows accept, some reject
    inp = vars(StepInput.build([None] * rows, 3, 1, rows))
    inp["tokens"][:, 1:], inp["valid"][:] = drafts, True
    inp["seeds"][:], inp["slots"][:] = np.arange(rows), np.arange(rows)
    inp["temperature"][:] = 0.8
    arrays = {name: jnp.asarray(inp[name]) for name in (*SAMPLING_INPUTS, "tokens", "valid")}
    packed, counts, _ = verify_fn(jnp.asarray(np.tile(logits, (rows, 1, 1))), jnp.zeros(rows, jnp.int32), arrays,
                                  sort=False, top=False)
    tokens, counts = np.asarray(packed[..., 0]).astype(int), np.asarray(counts)
    scaled = logits.astype(np.float64) / 0.8
    p = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert stats.chisquare(first, p[0] * first.sum()).pvalue > 1e-3
    second = np.bincount(tokens[counts >= 2, 1], minlength=vocab)  # given the first draft was taken
    assert stats.chisquare(second, p[1] * second.sum()).pvalue > 1e-3
    assert 0.01 < (counts >= 2).mean() < 0.99  # both paths taken


@pytest.mark.gpu
def test_ngram_speculation_through_the_kernels_on_the_gpu(tmp_path):
    """On a GPU the verify rows attend through the Mosaic GPU decode kernel, a row per query: greedy tokens equal
    those without speculation, on a model of head_dim 64 whose prompts repeat themselves. The kernel's tensor-core
    operands are bfloat16 even for float32 pages, and a drafted token's K/V, computed in a several-row product, can
    round to the other side of a bfloat16 value than the one-token step's: a request may part from its plain
    tokens only where the plain run's best two tokens are that close, and then takes the second."""
    from jaxserve.checkpoint import load_model
    from jaxserve.runner import build_engine
    from tests.tiny_models import hf_tiny, write_gguf

    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, hf_tiny("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2))
    model = load_model(path, dtype="float32")
    prompts = [[(7 * i + j) % 50 + 3 for j in range(12)] * 3 for i in range(16)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)] * 16
    with jax.default_matmul_precision("highest"):  # (the XLA products: only the kernel's rounding is left)
        want = build_engine(model, ENGINE).generate(prompts, params)
        spec = build_engine(model, dataclasses.replace(ENGINE, speculative=NGRAM))
        got = spec.generate(prompts, params)
    assert spec.spec.num_drafts > 0 and spec.spec.num_accepted_tokens > 0
    parted = 0
    for g, w in zip(got, want):
        if g.output_ids == w.output_ids:
            continue
        parted += 1
        j = next(j for j, (a, b) in enumerate(zip(g.output_ids, w.output_ids)) if a != b)
        (_, top), taken = w.logprobs[j], g.output_ids[j]
        assert [t for t, _ in top] == [w.output_ids[j], taken] and top[0][1] - top[1][1] < 1e-2, (j, top, taken)
    assert parted <= 2, f"{parted} of 16 requests parted from their plain tokens"


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, smollm) -> str:
    """A small random Llama with the target's vocabulary, saved as transformers saves it."""
    from tests.tiny_models import hf_tiny, save_tiny

    path = tmp_path_factory.mktemp("random-draft")
    save_tiny(hf_tiny("llama", vocab_size=smollm.config.vocab_size), path)
    return str(path)


@pytest.fixture(scope="module")
def random_llama(random_draft):
    """That random Llama loaded as a target, for the checks that hold for any model."""
    from jaxserve.checkpoint import load_model

    return load_model(random_draft, dtype="float32")


@pytest.mark.parametrize("target", ["random", "embedded"])
def test_greedy_tokens_are_identical_with_a_draft_model(smollm, prompts, random_draft, target, request):
    """A small random Llama of the embedded model's vocabulary as the draft. As its own target, over the 32 requests,
    it has every draft accepted; drafting for the embedded model, over the first 16, it has most rejected. Either way
    the tokens are the target's."""
    from jaxserve.runner import build_engine

    # (NGRAM's num_tokens: the embedded target's verify steps are then those the n-gram engine compiled)
    spec = SpeculativeConfig(method="draft", num_tokens=NGRAM.num_tokens, model=random_draft)
    if target == "embedded":
        model, (prompts, params, want) = smollm, request.getfixturevalue("greedy_load")
    else:
        model, params = request.getfixturevalue("random_llama"), load_params(len(prompts))
        want = [r.output_ids for r in build_engine(model, ENGINE).generate(prompts, params)]
    engine = build_engine(model, dataclasses.replace(ENGINE, speculative=spec))
    assert [r.output_ids for r in engine.generate(prompts, params)] == want
    rate = engine.spec.num_accepted_tokens / engine.spec.num_draft_tokens
    assert rate > 0.97 if target == "random" else rate < 0.5, engine.spec
    pages = engine.scheduler.pages
    assert pages.num_available == pages.num_pages


def test_preemption_under_speculation_and_the_spec_decode_metrics(random_llama):
    """With too few pages for every sequence, speculating requests are preempted and recomputed and still give
    their greedy tokens; the counters reach the Prometheus registry under vLLM's names. On the small random model
    (what is checked holds for any model), its prompts repeating themselves so that n-gram lookup drafts."""
    from prometheus_client import generate_latest

    from jaxserve.runner import build_engine
    from jaxserve.server.metrics import Metrics

    model = random_llama
    tight = dataclasses.replace(ENGINE, max_slots=8, decode_row_buckets=(8,), num_pages=20)
    prompts = [[(7 * i + j) % 50 + 3 for j in range(12)] * 3 for i in range(8)]  # 8 x 56 tokens in 20 pages of 16
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 8
    want = [r.output_ids for r in build_engine(model, tight).generate(prompts, params)]
    engine = build_engine(model, dataclasses.replace(tight, speculative=NGRAM))
    got = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.spec.num_draft_tokens > 0
    assert [r.output_ids for r in got] == want
    metrics = Metrics("m")
    metrics._engine.engine = engine
    page = generate_latest(metrics.registry).decode()
    assert f'jaxserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(engine.spec.num_accepted_tokens)}' \
        in page and 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in page
