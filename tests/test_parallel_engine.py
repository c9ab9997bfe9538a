"""The engine on a mesh: the embedded model with --tp 3 --sp 4 on 12 fake CPU devices, a context longer
than one device's pages, the command-line flags, and a two-process jax.distributed group on localhost."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from jaxserve.checkpoint import LoadedModel, save_model
from jaxserve.cli import build_parser, parallel_from_args
from jaxserve.config import EngineConfig, ParallelConfig, SamplingParams, engine_config_for
from jaxserve.runner import build_engine
from tests.helpers import cpu_env, free_port, random_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax.device_count() < 12, reason="needs 12 devices (XLA_FLAGS, see tests/conftest.py)")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_pool(parallel: ParallelConfig) -> EngineConfig:
    """8 pages of 8 tokens: with sp=4 each device holds 2 of them, 16 tokens."""
    return EngineConfig(max_slots=1, page_size=8, num_pages=8, max_pages_per_slot=8, chunk_buckets=(16,),
                        parallel=parallel)


def test_tp3_sp4_greedy_equals_one_device_and_serves_a_context_no_device_holds(smollm):
    """A random 2-layer model of the embedded model's head layout (3 KV heads, 3 query heads each) and tokenizer."""
    model = random_model(smollm, 5, hidden_size=96, intermediate_size=128, num_heads=9, num_kv_heads=3, head_dim=32)
    tok = model.tokenizer
    short = tok.encode("The capital of France is")
    long = tok.encode("Once upon a time, in a land far away, there lived a king who had three daughters. The eldest "
                      "was wise, the second was brave, and the youngest")
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
    sharded = build_engine(model, small_pool(ParallelConfig(tp=3, sp=4)))
    per_device = sharded.runner.state.cache.k[0].addressable_shards[0].data.shape
    assert per_device == (1, 2, 8, 32)  # one of the 3 KV heads, 2 of the 8 pages
    assert len(long) + 8 > 2 * 8, "the long prompt's KV must not fit one device's pages"
    on_mesh = [r.output_ids for r in sharded.generate([short, long], params)]
    alone = [r.output_ids for r in build_engine(model, small_pool(ParallelConfig())).generate([short, long], params)]
    assert on_mesh == alone
    assert len(set(on_mesh[0] + on_mesh[1])) > 2  # (not one token over and over, which any sharding would give)
    sharded.scheduler.pages.check()


def test_parallel_flags_reach_the_engine_config():
    for command in ("generate", "bench", "serve"):
        extra = ["prompt"] if command == "generate" else []
        args = build_parser().parse_args([command, "--tp", "3", "--sp", "4", *extra])
        assert parallel_from_args(args) == ParallelConfig(tp=3, sp=4, dp=1), command


@pytest.fixture(scope="module")
def tiny(smollm, tmp_path_factory) -> tuple[LoadedModel, str]:
    """A random 2-layer model (4 query heads, 2 KV heads) with the embedded tokenizer, saved to disk."""
    model = random_model(smollm, 3)
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    save_model(model, path)
    return model, path


def jaxserve(*args: str, devices: int = 12) -> subprocess.Popen:
    env = cpu_env(devices, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def test_a_tp_that_does_not_divide_the_heads_is_a_clear_cli_error(tiny):
    proc = jaxserve("generate", "--model", tiny[1], "--tp", "3", "--max-tokens", "1", "Hi")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2
    assert "--tp 3 does not divide the model's 4 query heads; use a tp among [1, 2, 4]" in err


def test_two_processes_on_localhost_generate_the_tokens_of_one(tiny):
    """tp=2 within each process, sp=2 across the two: every step crosses processes."""
    model, path = tiny
    prompt = "Hello there, how are you doing today my friend?"
    ids = model.tokenizer.encode(prompt)
    expected = build_engine(model, engine_config_for([len(ids)], 5)).generate(
        [ids], [SamplingParams(max_tokens=5)])[0].output_ids
    address = f"localhost:{free_port()}"
    procs = [jaxserve("generate", "--model", path, "--json", "--max-tokens", "5", "--tp", "2", "--sp", "2",
                      "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i), prompt,
                      devices=2) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    printed = [[line for line in out.splitlines() if line.startswith("{")] for out, _ in outs]  # not Gloo's lines
    assert len(printed[0]) == 1 and printed[1] == [], "the leader prints the result, the follower nothing"
    leader = json.loads(printed[0][0])
    assert leader["prompt_token_ids"] == ids and leader["token_ids"] == expected


def test_a_two_process_batch_job_quantizes_on_both_and_gives_the_results_of_one(tiny, tmp_path):
    """`jaxserve batch` starts the group (it did not), and the follower loads the leader's int8 weights (a follower
    once loaded them unquantized)."""
    from jaxserve.config import QuantConfig
    from jaxserve.model.quant import quantize_weights

    model, path = tiny
    prompts = ["Hello there, how are you doing today my friend?", "The capital of France is"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": p, "max_tokens": 4}) + "\n"
                                               for i, p in enumerate(prompts)))
    # (one slot, the prompts one after the other: the fewest sharded steps and samplers for each process to compile)
    engine = EngineConfig(max_slots=1, page_size=8, num_pages=16, max_pages_per_slot=8, chunk_buckets=(16,))
    on_mesh = dataclasses.replace(engine, parallel=ParallelConfig(tp=2, sp=2))
    config = tmp_path / "batch.yaml"
    config.write_text(json.dumps({"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out.jsonl"),
                                  "model": path, "quantize": {"mode": "int8"}, "progress": False,
                                  "engine": dataclasses.asdict(on_mesh)}))
    quantized = LoadedModel(model.config, quantize_weights(model.weights, QuantConfig(mode="int8"), jax.numpy.float32),
                            model.tokenizer, "tiny-int8")
    ids = [model.tokenizer.encode(p) for p in prompts]
    one = build_engine(quantized, engine)
    expected = [r.output_ids for r in one.generate(ids, [SamplingParams(max_tokens=4)] * 2)]
    address = f"localhost:{free_port()}"
    procs = [jaxserve("batch", "--config", str(config), "--coordinator-address", address, "--num-processes", "2",
                      "--process-id", str(i), devices=2) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    records = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert len(records) == 2
    for i in range(2):
        text = records[f"r{i}"]["response"]["body"]["choices"][0]["text"]
        assert text == model.tokenizer.decode(expected[i]), (i, text)
