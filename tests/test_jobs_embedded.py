"""Batch jobs on the embedded model: 50 requests with 3 malformed lines, and two shards merged.

A run killed and restarted is tested on a tiny model in tests/test_jobs.py (it starts the CLI
three times, which on the embedded model would cost minutes of loading and compiling).
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.cli import main
from jaxserve.config import BatchConfig, SamplingParams, ServerConfig
from jaxserve.engine.validation import Limits
from jaxserve.jobs.input import parse_line, read_lines
from jaxserve.jobs.runner import BatchJob
from jaxserve.runner import build_engine
from tests.helpers import SERVING_ENGINE
from tests.test_jobs import comparable, read_output, write_lines

pytestmark = pytest.mark.slow

ENGINE = SERVING_ENGINE
MALFORMED = {7: '{"custom_id": "r6", "prompt": ', 23: '["not", "an", "object"]',
             41: '{"custom_id": "r40", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}}'}
MODEL = "SmolLM2-135M-Instruct"


def fifty_lines() -> list:
    """47 requests (completions and chat, OpenAI and plain form, text and token ids) and 3 malformed lines."""
    topics = ["France", "Python", "the moon", "bread", "rivers", "music", "chess", "winter"]
    lines: list = []
    for i in range(50):
        topic = topics[i % len(topics)]
        if i + 1 in MALFORMED:
            lines.append(MALFORMED[i + 1])
        elif i % 8 == 0:
            lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": MODEL, "messages": [{"role": "user", "content": f"One fact about {topic}?"}],
                                   "max_tokens": 4}})
        elif i % 4 == 1:
            lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": f"A short story about {topic}:", "max_tokens": 1 + i % 4}})
        elif i % 4 == 2:
            lines.append({"custom_id": f"r{i}", "prompt": f"{i} facts about {topic} are", "stop": [","]})
        else:
            lines.append({"custom_id": f"r{i}", "prompt": [504, 3575, 282, 4649 + i, 314], "max_tokens": 3})
    return lines


def run_job(engine, cfg: BatchConfig, shard_index: int = 0):
    with BatchJob(cfg, shard_index=shard_index) as job:
        return job.run(engine, MODEL)


@pytest.fixture(scope="module")
def engine(smollm):
    return build_engine(smollm, ENGINE)


@pytest.fixture(scope="module")
def fifty(engine, tmp_path_factory):
    """The 50-line input, its unsharded run's config, summary and records."""
    tmp = tmp_path_factory.mktemp("fifty")
    src = write_lines(tmp / "in.jsonl", fifty_lines())
    cfg = BatchConfig(input=src, output=str(tmp / "out.jsonl"), engine=ENGINE, sampling=SamplingParams(max_tokens=4),
                      progress=False)
    summary = run_job(engine, cfg)
    return cfg, summary, read_output(cfg.output)


def test_fifty_requests_with_three_malformed_lines_give_47_results_and_3_error_records(fifty, engine, smollm):
    cfg, summary, records = fifty
    results = [r for r in records if r["error"] is None]
    errors = [r for r in records if r["error"] is not None]
    assert (len(records), len(results), len(errors)) == (50, 47, 3)
    assert (summary.completed, summary.errors, summary.lines, summary.already_done) == (47, 3, 50, 0)
    assert {r["error"]["line"]: r["error"]["code"] for r in errors} == {
        7: "invalid_json", 23: "invalid_json", 41: "invalid_request"}
    assert {r["custom_id"] for r in errors} == {None, "r40"}
    assert all(r["response"] is None and r["error"]["message"].startswith(f"line {r['error']['line']}: ")
               for r in errors)
    assert {r["custom_id"] for r in results} == {f"r{i}" for i in range(50)} - {"r6", "r22", "r40"}

    # Each result is what the engine makes of that line's request: the right text under the right custom_id
    # (checked on every third request, chat and completions, to keep the test short).
    items = [parse_line(raw, n, cfg.sampling) for n, raw in read_lines(cfg.input) if n not in MALFORMED][::3]
    assert {item.url for item in items} == {"/v1/completions", "/v1/chat/completions"}
    limits = Limits.of(engine, ServerConfig())
    direct = engine.generate([item.prompt_ids(smollm.tokenizer, limits) for item in items],
                             [item.params(limits) for item in items])
    by_id = {r["custom_id"]: r["response"] for r in results}
    for item, request in zip(items, direct):
        response = by_id[item.custom_id]
        assert response["status_code"] == 200
        body = response["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if item.url.endswith("chat/completions") else choice["text"]
        assert (text, choice["finish_reason"]) == (request.text, request.finish_reason), item.custom_id
        usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}  # (cached: run-dependent)
        assert usage == {"prompt_tokens": len(request.prompt_ids), "completion_tokens": len(request.output_ids),
                         "total_tokens": len(request.prompt_ids) + len(request.output_ids)}
        assert body["object"] == ("chat.completion" if item.messages else "text_completion") and body["model"] == MODEL
    chat_prompt = smollm.tokenizer.decode(items[0].prompt_ids(smollm.tokenizer, limits), skip_special_tokens=False)
    assert chat_prompt.startswith("<|im_start|>system") and "One fact about France?<|im_end|>" in chat_prompt
    assert by_id["r2"]["body"]["choices"][0]["finish_reason"] in ("stop", "length")
    assert summary.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results)
    assert summary.prompt_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in results)
    assert summary.output_tokens_per_s > 0


def test_two_shards_merged_equal_one_unsharded_run(fifty, engine, tmp_path):
    cfg, _, records = fifty
    sharded = dataclasses.replace(cfg, output=str(tmp_path / "out.jsonl"), num_shards=2)
    summaries = [run_job(engine, sharded, shard_index=i) for i in (0, 1)]
    shards = [str(tmp_path / f"out.shard-0000{i}-of-00002.jsonl") for i in (0, 1)]
    assert [s.lines for s in summaries] == [25, 25] and [s.output for s in summaries] == shards
    assert main(["batch", "merge", "--input", cfg.input, "--output", str(tmp_path / "merged.jsonl"), *shards]) == 0
    merged = read_output(tmp_path / "merged.jsonl")
    assert comparable(merged) == comparable(records)
    order = [r["custom_id"] if r["custom_id"] is not None else r["error"]["line"] for r in merged]
    assert order == [f"r{i}" if i + 1 not in (7, 23) else i + 1 for i in range(50)], "merged in input order"


def test_poison_lines_get_error_records_and_every_good_line_its_result(engine, smollm, tmp_path):
    poison = {  # custom_id -> what its error record says
        "seed": ({"prompt": "x", "seed": -1}, "seed=-1 must be an integer in [0, 4294967295]"),
        "nan": ({"prompt": "x", "temperature": float("nan")}, "temperature=nan must be a finite number"),
        "inf": ({"prompt": "x", "temperature": float("inf")}, "temperature=inf must be a finite number"),
        "stops": ({"prompt": "x", "stop": ["s"] * 10_000}, "stop has 10000 strings; at most 8"),
        "template": ({"messages": [{"role": "user", "content": "boom"}]}, "ZeroDivisionError"),
        "role": ({"messages": [{"role": "<|im_start|>system", "content": "x"}]}, "messages[0].role="),
        "vocab": ({"prompt": [1, 10**9]}, "prompt[1]=1000000000 is outside the vocabulary"),
        "long": ({"prompt": [5] * 510, "max_tokens": 10}, "the prompt of 510 tokens plus max_tokens=10 is 520 tokens"),
        "huge": ({"prompt": "word " * 100_000}, "(max_prompt_bytes)"),
    }
    lines = []
    for i in range(12):
        lines.append({"custom_id": f"good{i}", "prompt": f"{i} facts about rivers are", "max_tokens": 2})
        if i < len(poison):
            cid = list(poison)[i]
            lines.append({"custom_id": cid, **poison[cid][0]})
    lines.append({"custom_id": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    cfg = BatchConfig(input=write_lines(tmp_path / "in.jsonl", lines), output=str(tmp_path / "out.jsonl"),
                      engine=ENGINE, progress=False)
    tok = smollm.tokenizer
    original = tok.chat_template
    # a template that fails at run time on one message (it renders the others as the model's own does)
    tok.chat_template = "{% if messages[0]['content'] == 'boom' %}{{ 1 / 0 }}{% endif %}" + original
    try:
        summary = run_job(engine, cfg)
    finally:
        tok.chat_template = original
    records = {r["custom_id"]: r for r in read_output(cfg.output)}
    assert summary.completed == 13 and summary.errors == len(poison)
    for i in range(12):
        assert records[f"good{i}"]["error"] is None and records[f"good{i}"]["response"]["status_code"] == 200
    assert records["chat"]["error"] is None
    for cid, (_, message) in poison.items():
        error = records[cid]["error"]
        assert error["code"] == "invalid_request" and message in error["message"], (cid, error)


def test_sampling_fields_n_choices_and_logprobs_in_a_line(engine, tmp_path):
    """A line takes every sampling field the HTTP API takes; its result has n choices and the log-probabilities it
    asked for, in the HTTP API's body."""
    lines = [{"custom_id": "many", "prompt": "The capital of France is", "n": 2, "temperature": 1.0, "seed": 5,
              "max_tokens": 4, "logprobs": 2, "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05,
              "logit_bias": {"28": -5}, "min_tokens": 2, "prompt_logprobs": 1},
             {"custom_id": "chat", "url": "/v1/chat/completions", "method": "POST",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
                       "top_logprobs": 2}}]
    cfg = BatchConfig(input=write_lines(tmp_path / "in.jsonl", lines), output=str(tmp_path / "out.jsonl"),
                      engine=ENGINE, progress=False)
    run_job(engine, cfg)
    records = {r["custom_id"]: r for r in read_output(cfg.output)}
    many = records["many"]["response"]["body"]
    assert [c["index"] for c in many["choices"]] == [0, 1] and many["usage"]["completion_tokens"] == 8
    for choice in many["choices"]:
        assert len(choice["logprobs"]["token_logprobs"]) == 4
        assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 5
    assert many["choices"][0]["text"] != many["choices"][1]["text"]
    content = records["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 2 for t in content)
