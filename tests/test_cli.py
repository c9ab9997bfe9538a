"""The jaxserve command line on the embedded model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import SERVING_ENGINE

pytestmark = pytest.mark.slow


def jaxserve(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "jaxserve")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def test_generate_json_continues_with_paris_and_keeps_prompt_order():
    proc = jaxserve("generate", "--json", "--max-tokens", "12", "The capital of France is", "def add(a, b):")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["The capital of France is", "def add(a, b):"]
    first = lines[0]
    assert first["text"].startswith(" Paris")
    assert set(first) >= {"text", "token_ids", "prompt_token_ids", "finish_reason"}
    assert first["prompt_token_ids"] == [504, 3575, 282, 4649, 314]
    assert first["finish_reason"] in ("stop", "length") and 1 <= len(first["token_ids"]) <= 12


def test_generate_chat_and_sampling_flags():
    proc = jaxserve("generate", "--chat", "--json", "--max-tokens", "16", "--temperature", "0.7", "--top-k", "40",
                    "--top-p", "0.9", "--seed", "3", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_token_ids"][:1] == [1]  # <|im_start|>
    again = json.loads(jaxserve("generate", "--chat", "--json", "--max-tokens", "16", "--temperature", "0.7",
                                "--top-k", "40", "--top-p", "0.9", "--seed", "3",
                                "What is the capital of France?").stdout)
    assert again["token_ids"] == out["token_ids"], "same seed, same tokens"


# 47 tokens: with 5 more, the engine `generate` sizes for it is the chat test's (one slot, 4 pages, chunks of 16 and
# 64), whose steps the session's compilation cache then holds for the second of the two to run
CAPITALS = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. The capital "
            "of Spain is Madrid. The capital of Portugal is Lisbon. The capital of Austria is Vienna. The capital of "
            "Greece is")


def test_generate_takes_every_sampling_field():
    proc = jaxserve("generate", "--json", "--max-tokens", "5", "--temperature", "1.0", "--seed", "4", "--n", "2",
                    "--min-p", "0.05", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                    "--repetition-penalty", "1.2", "--logit-bias", "11=-100", "--min-tokens", "5", "--logprobs", "2",
                    "--prompt-logprobs", "1", CAPITALS)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [s["index"] for s in samples] == [0, 1] and samples[0]["token_ids"] != samples[1]["token_ids"]
    for s in samples:
        assert len(s["token_ids"]) == 5 and 11 not in s["token_ids"]
        assert len(s["logprobs"]) == 5 and all(len(e["top"]) == 2 for e in s["logprobs"])
        assert s["prompt_logprobs"][0] is None and len(s["prompt_logprobs"]) == len(s["prompt_token_ids"]) == 47
    bad = jaxserve("generate", "--logit-bias", "eleven=1", "x")
    assert bad.returncode != 0 and "--logit-bias 'eleven=1' must be TOKEN=BIAS" in bad.stderr


def test_info_json_reports_config_and_bytes():
    proc = jaxserve("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["config"]["num_layers"] == 30 and info["config"]["num_kv_heads"] == 3
    assert info["parameters"] == 134_515_008
    assert info["parameter_bytes"] == 4 * info["parameters"]


def test_bench_json_reports_throughput_and_latency():
    # (one request: bench sizes its engine to the load, and one slot is the fewest steps to compile)
    proc = jaxserve("bench", "--num-requests", "1", "--input-len", "20", "--output-len", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["requests"] == 1 and result["output_tokens"] == 5
    assert result["output_tokens_per_s"] > 0 and result["wall_s"] > 0
    assert 0 < result["ttft_p50_s"] < result["wall_s"] and result["itl_p50_s"] > 0
    # the engine thread's time, split: waiting on the device and the host work's three parts, within the wall
    parts = [result[f"{p}_fraction"] for p in ("device_wait", "schedule", "dispatch", "commit")]
    assert all(f > 0 for f in parts) and sum(parts) <= 1.0


def test_bench_with_a_serve_config_runs_that_configs_engine(tmp_path):
    config = tmp_path / "serve.yaml"
    # (the test modules' servers compile the same steps, which the session's cache holds; JSON is YAML)
    config.write_text(json.dumps({"engine": dataclasses.asdict(SERVING_ENGINE)}))
    proc = jaxserve("bench", "--config", str(config), "--num-requests", "4", "--input-len", "20", "--output-len", "5",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["max_slots"], result["output_tokens"]) == (4, 20)
    both = jaxserve("bench", "--config", str(config), "--max-slots", "2")
    assert both.returncode == 2 and "--max-slots=2 and --config both size the engine" in both.stderr


def test_bench_rejects_bad_sizes():
    proc = jaxserve("bench", "--num-requests", "0")
    assert proc.returncode == 2 and "--num-requests must be at least 1, got 0" in proc.stderr
