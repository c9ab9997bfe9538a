"""Constrained decoding through the engine on the embedded model: JSON schemas, regexes, choices and Lark grammars
(jaxserve.engine.grammar), the masks on the device (sampler.only_allowed), and rows without a constraint beside
them."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve.config import SamplingParams
from jaxserve.engine.grammar import Grammars, allowed, compile_grammar
from jaxserve.model.sampler import only_allowed
from tests.helpers import EMBEDDED_ENGINE, logits_of

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm):
    from jaxserve.runner import build_engine

    return build_engine(smollm, EMBEDDED_ENGINE)


def chat(smollm, text: str) -> list[int]:
    return smollm.tokenizer.encode_chat([{"role": "user", "content": text}])


def schemas() -> list[dict]:
    """50 schemas: nested objects, enums, arrays, bounded numbers, required fields, additionalProperties false."""
    colors = ["red", "green", "blue", "black"]
    out = []
    for i in range(50):
        props: dict = {"id": {"type": "integer", "minimum": i, "maximum": i + 100}}
        if i % 2 == 0:
            props["name"] = {"type": "string", "maxLength": 12}
        if i % 3 == 0:
            props["color"] = {"enum": colors[: 2 + i % 3]}
        if i % 4 == 0:
            props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
                             "maxItems": 3}
        if i % 5 == 0:
            props["address"] = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                "required": ["city", "zip"], "additionalProperties": False}
        if i % 7 == 0:
            props["score"] = {"type": "number", "minimum": 0, "maximum": 1}
        if i % 6 == 1:
            props["active"] = {"type": "boolean"}
        if i % 8 == 3:
            props["sizes"] = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 4}
        required = sorted(props)[: 1 + i % len(props)] if i % 3 else sorted(props)
        out.append({"type": "object", "properties": props, "required": required, "additionalProperties": False})
    return out


def test_fifty_json_schemas_each_output_parses_and_validates(smollm, engine):
    subjects = ["a customer", "a city", "a product", "a student", "an employee"]
    prompts, params = [], []
    for i, schema in enumerate(schemas()):
        prompts.append(chat(smollm, f"Describe {subjects[i % 5]} (number {i}) as JSON with the fields "
                                    f"{', '.join(schema['properties'])}."))
        params.append(SamplingParams(max_tokens=160, grammar=compile_grammar("json_schema", schema)))
    before = engine.stats.masked_steps
    done = engine.generate(prompts, params)
    for i, (request, schema) in enumerate(zip(done, schemas(), strict=True)):
        assert request.finish_reason == "stop", (i, request.text)  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(request.text), schema)
    assert engine.stats.masked_steps > before


def test_regex_choice_and_lark_outputs_match(smollm, engine):
    prompt = chat(smollm, "Give me a product code and say whether you like it.")
    kinds = [("regex", r"[A-Z]{3}-[0-9]{2,4}"), ("regex", r"(yes|no), because [a-z ]{1,20}\."),
             ("choice", ["positive", "negative", "neutral"]), ("grammar", 'start: "id=" NUM ";"\nNUM: /[0-9]{1,3}/')]
    done = engine.generate([prompt] * len(kinds),
                           [SamplingParams(max_tokens=40, grammar=compile_grammar(k, v)) for k, v in kinds])
    assert re.fullmatch(kinds[0][1], done[0].text)
    assert re.fullmatch(kinds[1][1], done[1].text)
    assert done[2].text in kinds[2][1]
    assert re.fullmatch(r"id=[0-9]{1,3};", done[3].text)
    assert all(r.finish_reason == "stop" for r in done)


def test_constrained_greedy_tokens_are_the_best_allowed_at_every_step(smollm, engine):
    """The mask a step applies follows from exactly the tokens before it (the engine reads step N before it gives
    step N+1 its masks): step by step, each token is the argmax of the full forward's logits over the allowed ones;
    and where the grammar leaves no choice a token the model itself would not pick is forced."""
    prompt = chat(smollm, "How old is the Eiffel tower?")
    grammar = compile_grammar("regex", "[0-9]{2} (years|months)")
    got = engine.generate([prompt], [SamplingParams(max_tokens=40, grammar=grammar)])[0]
    grammars = Grammars(smollm.tokenizer, smollm.config.vocab_size)
    matcher = grammars.matcher(grammar)
    expected: list[int] = []
    forced = False
    while not matcher.is_stopped() and len(expected) < 40:
        logits = logits_of(smollm, prompt + expected)[-1]
        ok = allowed(grammars.masks([matcher])[0])
        token = int(ok[np.argmax(logits[ok])])
        forced |= token != int(np.argmax(logits))
        expected.append(token)
        assert matcher.consume_token(token)
    assert got.output_ids == expected
    assert forced and re.fullmatch("[0-9]{2} (years|months)", got.text)


def test_unconstrained_rows_give_what_they_give_alone(smollm, engine):
    """Rows without a constraint share steps with constrained ones (greedy and sampled, with log-probabilities)
    and produce exactly what they produce without them; a step with no constrained row runs no mask."""
    prompts = [chat(smollm, t) for t in ("Tell me about the sea.", "Write a haiku about rain.", "Name a fruit.")]
    free = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7)]
    before = engine.stats.masked_steps
    alone = engine.generate(prompts[:2], free)
    assert engine.stats.masked_steps == before
    mixed = engine.generate(prompts, [*free, SamplingParams(max_tokens=24, grammar=compile_grammar(
        "json_schema", {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}))])
    for a, m in zip(alone, mixed[:2], strict=True):
        assert m.output_ids == a.output_ids and m.text == a.text
    assert [lp[0] for lp in mixed[0].logprobs] == pytest.approx([lp[0] for lp in alone[0].logprobs], abs=1e-4)
    assert engine.stats.masked_steps > before


def test_sampled_constrained_rows_follow_the_grammar(smollm, engine):
    prompt = chat(smollm, "Describe a person.")
    grammar = compile_grammar("json_schema", PERSON)
    done = engine.generate([prompt] * 4, [SamplingParams(max_tokens=60, temperature=1.2, top_p=0.95, seed=s,
                                                         grammar=grammar) for s in range(4)])
    texts = [r.text for r in done]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1


def test_the_device_mask_allows_exactly_the_host_mask_bits(smollm):
    """sampler.only_allowed reads llguidance's packed layout: the tokens left finite are the ones the host lists,
    bit 31 of a word included; a row with every bit set is left as it is."""
    vocab = smollm.config.vocab_size
    grammars = Grammars(smollm.tokenizer, vocab)
    matchers = [grammars.matcher(compile_grammar("choice", ["yes", "no"])),
                grammars.matcher(compile_grammar("json_schema", PERSON)), None]
    masks = grammars.masks(matchers)
    masks[0, 3] |= np.int32(-2**31)  # token 3 * 32 + 31 as well
    logits = np.random.default_rng(0).standard_normal((3, vocab)).astype(np.float32)
    out = np.asarray(only_allowed(jnp.asarray(logits), jnp.asarray(masks)))
    for row in range(3):
        finite = np.flatnonzero(np.isfinite(out[row]))
        assert finite.tolist() == allowed(masks[row])[allowed(masks[row]) < vocab].tolist()
    assert 127 in np.flatnonzero(np.isfinite(out[0]))
    np.testing.assert_array_equal(out[2], logits[2])
    yes = smollm.tokenizer.encode("yes", add_special_tokens=False)[0]
    assert yes in allowed(masks[0]) and len(allowed(masks[1])) < vocab // 10


def test_constraints_that_cannot_compile_name_the_problem():
    with pytest.raises(ValueError, match="foo"):
        compile_grammar("json_schema", {"type": "foo"})
    with pytest.raises(ValueError, match="unclosed group"):
        compile_grammar("regex", "a(b")
    with pytest.raises(ValueError, match="unknown name"):
        compile_grammar("grammar", 'start: x\nx: "a" y')
