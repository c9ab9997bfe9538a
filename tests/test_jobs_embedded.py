"""Batch jobs on the embedded model: 50 requests with 3 malformed lines, and two shards merged.

A run killed and restarted is tested on a tiny model in tests/test_jobs.py (it starts the CLI
three times, which on the embedded model would cost minutes of loading and compiling).
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.cli import main
from jaxserve.config import BatchConfig, EngineConfig, SamplingParams
from jaxserve.jobs.input import parse_line, read_lines
from jaxserve.jobs.runner import BatchJob
from jaxserve.step import build_engine
from tests.test_jobs import comparable, read_output, write_lines

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(max_slots=4, page_size=16, num_pages=32, max_pages_per_slot=4, chunk_buckets=(16,))
MALFORMED = {7: '{"custom_id": "r6", "prompt": ', 23: '["not", "an", "object"]',
             41: '{"custom_id": "r40", "url": "/v1/completions", "body": {"prompt": "x", "n": 3}}'}
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
    direct = engine.generate([item.prompt_ids(smollm.tokenizer) for item in items], [item.params for item in items])
    by_id = {r["custom_id"]: r["response"] for r in results}
    for item, request in zip(items, direct):
        response = by_id[item.custom_id]
        assert response["status_code"] == 200
        body = response["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if item.url.endswith("chat/completions") else choice["text"]
        assert (text, choice["finish_reason"]) == (request.text, request.finish_reason), item.custom_id
        assert body["usage"] == {"prompt_tokens": len(request.prompt_ids), "completion_tokens": len(request.output_ids),
                                 "total_tokens": len(request.prompt_ids) + len(request.output_ids)}
        assert body["object"] == ("chat.completion" if item.messages else "text_completion") and body["model"] == MODEL
    chat_prompt = smollm.tokenizer.decode(items[0].prompt_ids(smollm.tokenizer), skip_special_tokens=False)
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
