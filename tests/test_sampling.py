"""Per-request sampling through the engine on the embedded model: penalties (the device's token counts), logit
bias, min_tokens, n, prompt log-probabilities, and no compilation after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve.config import SamplingParams
from tests.helpers import SERVING_ENGINE, logits_of
from tests.test_sampler import reference

TEXT = ("The history of the city begins with a small village on the river, where fishermen and traders met to "
        "exchange goods. Over the centuries the village grew into a market town, then a port, and by the time the railway "
        "arrived it had become")


@pytest.fixture(scope="module")
def engine(smollm):
    from jaxserve.runner import build_engine

    # (chunks of at most 32 tokens: the prompt of ~40 crosses a chunk boundary)
    return build_engine(smollm, SERVING_ENGINE)


@pytest.fixture(scope="module")
def prompt(smollm):
    ids = smollm.tokenizer.encode(TEXT)
    assert 32 < len(ids) <= 64
    return ids


def run(engine, prompts, params):
    return engine.generate(prompts, params)


def test_penalized_greedy_tokens_match_a_step_by_step_reference(smollm, engine, prompt):
    """The penalties read the device's counts of the prompt's and the output's tokens, kept by the steps across
    chunked prefill and decode; beside them in the same steps, a plain greedy row and a sampled one give what they
    give alone."""
    penal = {"repetition": 1.3, "frequency": 0.5, "presence": 0.3}
    params = SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.3)
    plain, sampled = SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=10, ignore_eos=True,
                                                                                   temperature=1.0, seed=3)
    other = prompt[5:] + prompt[:5]
    together = run(engine, [prompt, other, other], [params, plain, sampled])
    alone = run(engine, [other, other], [plain, sampled])
    assert [r.output_ids for r in together[1:]] == [r.output_ids for r in alone]
    out: list[int] = []
    vocab = smollm.config.vocab_size
    in_prompt = np.zeros(vocab, bool)
    in_prompt[prompt] = True
    for _ in range(10):
        counts = np.bincount(out, minlength=vocab).astype(np.int32)
        out.append(reference(logits_of(smollm, prompt + out)[-1], counts, in_prompt, penal)[1])
    assert together[0].output_ids == out
    assert together[0].output_ids != run(engine, [prompt], [plain])[0].output_ids  # the penalties changed something


def test_logit_bias_and_min_tokens(engine, prompt):
    biased = run(engine, [prompt], [SamplingParams(max_tokens=6, logit_bias=((1234, 100.0),))])[0]
    assert biased.output_ids == [1234] * 6
    free = run(engine, [prompt], [SamplingParams(max_tokens=12, ignore_eos=True)])[0].output_ids
    stop = free[2]
    stopped = run(engine, [prompt], [SamplingParams(max_tokens=12, stop_token_ids=(stop,))])[0]
    assert stopped.output_ids == free[:3] and stopped.finish_reason == "stop"
    held = run(engine, [prompt], [SamplingParams(max_tokens=12, stop_token_ids=(stop,), min_tokens=8)])[0]
    assert stop not in held.output_ids[:8] and len(held.output_ids) >= 8
    text = engine.tokenizer.decode(free[:3])
    early = run(engine, [prompt], [SamplingParams(max_tokens=12, ignore_eos=True, stop=(text[-2:],), min_tokens=6)])[0]
    assert len(early.output_ids) >= 6  # the stop string in the first tokens waited for min_tokens


def test_n_samples_share_the_prefill_and_reproduce(engine, prompt):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=4, ignore_eos=True)
    first = run(engine, [prompt] * 4, params.children())
    outputs = [tuple(r.output_ids) for r in first]
    assert len(set(outputs)) == 4
    assert [tuple(r.output_ids) for r in run(engine, [prompt] * 4, params.children())] == outputs
    full_pages = (len(prompt) - 1) // 16 * 16
    assert [r.cached_tokens for r in first[1:]] == [full_pages] * 3  # each sibling waited and took the pages


def test_prompt_logprobs_equal_transformers_across_chunks(engine, prompt, hf_model):
    request = run(engine, [prompt], [SamplingParams(max_tokens=2, prompt_logprobs=5)])[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].double(), dim=-1).numpy()
    entries = request.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        logprob, top = entries[p]
        assert abs(logprob - ref[p - 1, prompt[p]]) < 1e-4, p
        assert len(top) == 5
        np.testing.assert_allclose([lp for _, lp in top], np.sort(ref[p - 1])[::-1][:5], atol=1e-4)
        assert top[0][0] == int(np.argmax(ref[p - 1]))


def test_no_compilation_after_warm_up_under_every_parameter(engine, prompt):
    from jaxserve.runner import compilation_count

    mixes = [SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1),
             SamplingParams(max_tokens=6, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
             SamplingParams(max_tokens=6, logit_bias=((5, 2.0), (6, -3.0)), min_tokens=4, logprobs=3),
             SamplingParams(max_tokens=6, prompt_logprobs=2, temperature=0.5, seed=9),
             *SamplingParams(max_tokens=6, temperature=1.0, n=3).children(),
             SamplingParams(max_tokens=6)]
    run(engine, [prompt[:20]], [SamplingParams(max_tokens=2)])  # anything lazy in the first run happens here
    before = compilation_count()
    run(engine, [prompt[i:] for i in range(len(mixes))], mixes)
    assert compilation_count() == before
