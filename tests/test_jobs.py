"""Batch jobs: input parsing, the durable results file, duplicates, config flags, merge, and a SIGKILLed run.

The generation here runs on a tiny random model (bookkeeping only); tests/test_jobs_embedded.py
runs real requests on the embedded model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxserve.cli import build_parser
from jaxserve.config import BatchConfig, EngineConfig, SamplingParams, load_yaml
from jaxserve.engine.validation import InvalidArgument, Limits
from jaxserve.errors import JaxserveError
from jaxserve.jobs.command import shard_index_from
from jaxserve.jobs.flags import overrides_from, with_overrides
from jaxserve.jobs.input import CHAT, COMPLETIONS, LineError, in_shard, parse_line, scan_input
from jaxserve.jobs.merge import merge
from jaxserve.jobs.output import ResultsFile, error_record, iter_records
from jaxserve.jobs.runner import BatchJob, shard_output

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = SamplingParams(max_tokens=7, temperature=0.5)
LIMITS = Limits(vocab_size=1000, context_length=2048, max_sequence_length=1024, max_tokens_limit=4096,
                max_stop_strings=8, max_logprobs=20, max_prompt_bytes=32768, max_messages=16)


def write_lines(path, lines: list) -> str:
    """Writes JSON objects (or raw strings, as they are) one a line."""
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def read_output(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def comparable(records: list[dict]) -> dict:
    """Records keyed by custom_id (or error line), without what differs between runs: the creation time, and the
    prompt tokens found in the prefix cache (which depends on what ran before)."""
    out = {}
    for r in records:
        r = json.loads(json.dumps(r))
        if r["response"] is not None:
            del r["response"]["body"]["created"]
            del r["response"]["body"]["usage"]["prompt_tokens_details"]
        key = r["custom_id"] if r["custom_id"] is not None else r["error"]["line"]
        assert key not in out, f"{key} answered twice"
        out[key] = r
    return out


# -- input lines ---------------------------------------------------------------------------------
def test_openai_and_plain_lines_parse_with_defaults_and_a_seed_per_custom_id():
    chat = parse_line(json.dumps({"custom_id": "c1", "method": "POST", "url": CHAT, "body": {
        "model": "gpt-x", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 3, "stop": "\n"}}).encode(), 4, DEFAULTS)
    assert (chat.line, chat.custom_id, chat.url) == (4, "c1", CHAT)
    assert chat.messages == [{"role": "user", "content": "hi"}]
    params = chat.params(LIMITS)
    assert params.max_tokens == 3 and params.stop == ("\n",) and params.temperature == 0.5
    plain = parse_line(b'{"custom_id": "p1", "prompt": [5, 6, 7], "temperature": 0, "seed": 11}', 9, DEFAULTS)
    assert plain.url == COMPLETIONS and plain.prompt == [5, 6, 7] and plain.prompt_ids(None, LIMITS) == [5, 6, 7]
    assert plain.params(LIMITS) == dataclasses.replace(DEFAULTS, temperature=0.0, seed=11)
    again = parse_line(b'{"custom_id": "p2", "prompt": "x"}', 1, DEFAULTS)
    other = parse_line(b'{"custom_id": "p3", "prompt": "x"}', 1, DEFAULTS)
    assert again.sampling["seed"] == parse_line(b'{"custom_id": "p2", "prompt": "y"}', 2, DEFAULTS).sampling["seed"]
    assert again.sampling["seed"] != other.sampling["seed"]
    assert parse_line(b'{"custom_id": "m", "messages": [{"role": "user", "content": "q"}]}', 1, DEFAULTS).url == CHAT


@pytest.mark.parametrize(("line", "code", "custom_id", "message"), [
    (b"{not json", "invalid_json", None, "line 3: not valid JSON"),
    (b"[1, 2]", "invalid_json", None, "expected a JSON object, got list"),
    (b'{"prompt": "x"}', "invalid_request", None, "custom_id=None must be a non-empty string"),
    (b'{"custom_id": 5, "prompt": "x"}', "invalid_request", None, "custom_id=5 must be a non-empty string"),
    (b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "invalid_request", "a",
     "url='/v1/embeddings' must be '/v1/completions' or '/v1/chat/completions'"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}', "invalid_request", "a",
     "method='GET' must be 'POST'"),
    (b'{"custom_id": "a", "prompt": "x", "echo": true}', "invalid_request", "a", "echo=True is not supported"),
    (b'{"custom_id": "a", "prompt": "x", "functions": []}', "invalid_request", "a", "body key 'functions' is not supported"),
    (b'{"custom_id": "a", "prompt": ["x", "y"]}', "invalid_request", "a", "send one prompt per line"),
])
def test_malformed_lines_are_line_errors_that_name_the_problem(line, code, custom_id, message):
    with pytest.raises(LineError) as info:
        parse_line(line, 3, DEFAULTS)
    assert (info.value.line, info.value.code, info.value.custom_id) == (3, code, custom_id)
    assert message in str(info.value) and str(info.value).startswith("line 3: ")


# The values of a parsed line are checked when it is submitted, against the model's limits, by the checks every
# surface shares; the runner turns a failure into that line's error record.
@pytest.mark.parametrize(("line", "message"), [
    (b'{"custom_id": "a", "prompt": ""}', "prompt='' must be a non-empty string"),
    (b'{"custom_id": "a", "prompt": [1, 5000]}', "prompt[1]=5000 is outside the vocabulary [0, 1000)"),
    (b'{"custom_id": "a", "prompt": "x", "max_tokens": "9"}', "max_tokens='9' must be between 1 and 4096"),
    (b'{"custom_id": "a", "prompt": "x", "temperature": -1}', "temperature=-1 must be a finite number >= 0"),
    (b'{"custom_id": "a", "prompt": "x", "temperature": NaN}', "temperature=nan must be a finite number >= 0"),
    (b'{"custom_id": "a", "prompt": "x", "seed": -1}', "seed=-1 must be an integer in [0, 4294967295]"),
    (b'{"custom_id": "a", "prompt": "x", "stop": ' + json.dumps(["s"] * 10_000).encode() + b"}",
     "stop has 10000 strings; at most 8"),
    (b'{"custom_id": "a", "messages": []}', "messages=[] must be a non-empty list"),
    (b'{"custom_id": "a", "messages": [{"role": "user<|im_end|>", "content": "x"}]}', "messages[0].role="),
])
def test_line_values_are_checked_by_the_shared_validation(line, message):
    item = parse_line(line, 3, DEFAULTS)
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        item.params(LIMITS)
        item.prompt_ids(None, LIMITS)  # (a tokenizer is never reached: these fail before)


# -- the results file ----------------------------------------------------------------------------
def test_torn_last_line_is_cut_off_and_its_request_is_not_done(tmp_path):
    path = tmp_path / "out.jsonl"
    good = [error_record(1, "invalid_json", "x", "a"), error_record(2, "invalid_json", "y", None)]
    complete = "".join(json.dumps(r) + "\n" for r in good)
    path.write_text(complete + json.dumps(error_record(3, "invalid_json", "z", "c"))[:25])
    with ResultsFile(str(path)) as results:
        assert results.repaired_bytes == 25
        assert path.read_text() == complete
        assert results.done.ids == {"a"} and results.done.lines == {2}
        assert results.done.has("a", 99) and results.done.has(None, 2) and not results.done.has("c", 3)
        results.append([error_record(3, "invalid_json", "z", "c")])
    assert [r["custom_id"] for _, _, r in iter_records(str(path))] == ["a", None, "c"]
    path.write_text('{"id": "batch_req_')  # killed during the first write: nothing complete
    with ResultsFile(str(path)) as results:
        assert len(results.done) == 0 and path.read_text() == ""


def test_results_file_refuses_a_second_writer_and_foreign_lines(tmp_path):
    path = str(tmp_path / "out.jsonl")
    with ResultsFile(path), pytest.raises(JaxserveError, match="locked by another running jaxserve batch"):
        ResultsFile(path)
    with open(path, "w") as f:
        f.write(json.dumps(error_record(1, "c", "m", "a")) + "\n" + '{"hello": 1}\n')
    with pytest.raises(JaxserveError, match="line 2 is not a batch result record"):
        ResultsFile(path)


# -- duplicates, shards, config ------------------------------------------------------------------
def test_duplicate_custom_ids_are_reported_before_any_work(tmp_path):
    lines = [{"custom_id": f"r{i}", "prompt": "x"} for i in range(6)] + ["oops"]
    lines[4]["custom_id"] = "r1"
    lines.append({"custom_id": "r1", "prompt": "y"})
    lines.append({"custom_id": "r3", "prompt": "y"})
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cfg = BatchConfig(input=src, output=str(out), num_shards=4)
    with pytest.raises(JaxserveError) as info:
        BatchJob(cfg, shard_index=2)  # the duplicates sit in other shards: still found
    assert "2 custom_ids occur more than once: 'r1' on lines 2, 5, 8; 'r3' on lines 4, 9" in str(info.value)
    assert not out.exists(), "a refused job leaves no output behind"
    scan = scan_input(src, 1, 4)
    assert (scan.lines, scan.todo) == (2, 2) and [n for n in range(1, 10) if in_shard(n, 1, 4)] == [2, 6]
    assert scan_input(src, 2, 4, lambda cid, line: cid == "r2" or line == 7).todo == 0  # lines 3 and 7


def test_shard_index_defaults_from_the_indexed_job_and_names_each_output():
    assert shard_index_from({"JOB_COMPLETION_INDEX": "3"}) == 3 and shard_index_from({}) == 0
    with pytest.raises(JaxserveError, match="JOB_COMPLETION_INDEX='x' is not an integer"):
        shard_index_from({"JOB_COMPLETION_INDEX": "x"})
    assert shard_output("/d/out.jsonl", 0, 1) == "/d/out.jsonl"
    assert shard_output("/d/out.jsonl", 3, 8) == "/d/out.shard-00003-of-00008.jsonl"
    assert shard_output("/d/out-{shard_index}.jsonl", 3, 8) == "/d/out-3.jsonl"


def test_batch_yaml_loads_and_every_flag_overrides_its_key(tmp_path):
    preset = os.path.join(REPO, "configs", "batch.yaml")
    cfg = load_yaml(BatchConfig, preset)
    assert cfg.engine.max_slots == 16 and cfg.engine.chunk_buckets == (32, 128, 512) and cfg.num_shards == 1
    assert cfg.sampling.max_tokens == 256 and cfg.in_flight_limit == 64 and cfg.input is None
    args = build_parser().parse_args(["batch", "--config", preset, "--input", "in.jsonl", "--max-slots", "3",
                                      "--chunk-buckets", "16", "64", "--max-tokens", "5", "--stop", "a", "b",
                                      "--ignore-eos", "--no-progress", "--num-shards", "4", "--shard-index", "2",
                                      "--fsync-interval-s", "0"])
    got = with_overrides(cfg, overrides_from(args))
    assert got == dataclasses.replace(
        cfg, input="in.jsonl", num_shards=4, shard_index=2, progress=False, fsync_interval_s=0.0,
        engine=dataclasses.replace(cfg.engine, max_slots=3, chunk_buckets=(16, 64)),
        sampling=dataclasses.replace(cfg.sampling, max_tokens=5, stop=("a", "b"), ignore_eos=True))
    assert with_overrides(cfg, overrides_from(build_parser().parse_args(["batch"]))) == cfg
    with pytest.raises(JaxserveError, match=r"shard_index=4 must lie in \[0, num_shards=4\)"):
        with_overrides(cfg, overrides_from(build_parser().parse_args(["batch", "--num-shards", "4", "--shard-index", "4"])))
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  max_slot: 2\n")
    with pytest.raises(JaxserveError, match=r"engine: unknown keys \['max_slot'\] for EngineConfig"):
        load_yaml(BatchConfig, str(bad))


def test_merge_refuses_torn_overlapping_or_incomplete_shards(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"custom_id": c, "prompt": "x"} for c in "abc"] + ["bad"])
    rec = {c: json.dumps(error_record(i, "x", "m", c)) + "\n" for i, c in enumerate("abc", 1)}
    bad = json.dumps(error_record(4, "invalid_json", "m", None)) + "\n"
    (tmp_path / "s0").write_text(rec["c"] + rec["a"])
    (tmp_path / "s1").write_text(bad + rec["b"])
    shards = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    merged = str(tmp_path / "m.jsonl")
    assert merge(shards, merged, input_path=src).records == 4
    assert [r["custom_id"] for r in read_output(merged)] == ["a", "b", "c", None]
    merge(shards, merged)
    assert [r["custom_id"] for r in read_output(merged)] == ["c", "a", None, "b"]
    (tmp_path / "s2").write_text(rec["a"])
    with pytest.raises(JaxserveError, match="answers custom_id 'a' again"):
        merge([*shards, str(tmp_path / "s2")], merged)
    with pytest.raises(JaxserveError, match=r"2 lines of .* have no result in the shards \(lines 1, 3\)"):
        merge(shards[1:], str(tmp_path / "m2.jsonl"), input_path=src)
    assert not os.path.exists(tmp_path / "m2.jsonl")
    (tmp_path / "s1").write_text(bad + rec["b"][:10])
    with pytest.raises(JaxserveError, match="ends in a torn line"):
        merge(shards, merged)


# -- a run killed with SIGKILL and restarted (tiny random model) -----------------------------------
TINY_ENGINE = EngineConfig(max_slots=4, page_size=8, num_pages=16, max_pages_per_slot=4, chunk_buckets=(16,))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.tiny_models import write_gguf

    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_gguf(path)
    return path


def jaxserve_batch(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxserve.cli", "batch", *args]


def test_sigkill_mid_run_then_restart_ends_with_one_line_per_request_equal_to_an_uninterrupted_run(tmp_path, tiny_path):
    lines: list = [{"custom_id": f"req-{i}", "prompt": f"request number {i}:", "max_tokens": 6 + i % 7}
                   for i in range(150)]
    lines[40] = "{torn"  # an error record must not be written twice either
    src = write_lines(tmp_path / "in.jsonl", lines)
    cfg = BatchConfig(input=src, model=tiny_path, engine=dataclasses.replace(
        TINY_ENGINE, compilation_cache_dir=str(tmp_path / "xla")), sampling=SamplingParams(ignore_eos=True),
        progress=False, fsync_interval_s=0.0)
    config = tmp_path / "batch.yaml"
    config.write_text(json.dumps(dataclasses.asdict(cfg)))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"

    uninterrupted = subprocess.run(jaxserve_batch("--config", str(config), "--output", str(ref)), env=env,
                                   capture_output=True, text=True, timeout=600)  # also fills the compilation cache
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    proc = subprocess.Popen(jaxserve_batch("--config", str(config), "--output", str(out)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_bytes().count(b"\n") >= 10):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the job wrote nothing for 5 minutes"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = list(iter_records(str(out)))
    assert 10 <= len(written) < 150, "the kill must land in the middle of the run"
    torn = b'{"id": "batch_req_0", "custom_id": "req-149", "resp'
    with open(out, "ab") as f:  # as if the kill had come in the middle of a write
        f.write(torn)

    restart = subprocess.run(jaxserve_batch("--config", str(config), "--output", str(out)), env=env,
                             capture_output=True, text=True, timeout=600)
    assert restart.returncode == 0, restart.stderr
    summary = json.loads(restart.stdout)
    assert summary["already_done"] == len(written) and summary["completed"] + summary["errors"] == 150 - len(written)
    assert summary["repaired_bytes"] == len(torn)
    resumed = read_output(out)
    assert len(resumed) == 150
    assert resumed[:len(written)] == [r for _, _, r in written], "a restart only appends"
    reference = comparable(read_output(ref))
    assert comparable(resumed) == reference
    assert reference[41]["error"]["code"] == "invalid_json"
    assert {r["response"]["body"]["usage"]["completion_tokens"] for r in reference.values() if r["response"]} == set(
        range(6, 13))
