"""lm-evaluation-harness against the HTTP API: its `local-completions` model runs a multiple-choice (log-likelihood)
task and a generate_until task, both on local files written here, through a real server on loopback. Every score,
and each sample's log-likelihoods and text, equal what transformers' model of the same checkpoint computes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers import SERVING_ENGINE, http_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "France: Paris\nGermany: Berlin\n{country}:"  # str.format here; Jinja in the task YAMLs
MULTIPLE_CHOICE = [
    {"country": "Italy", "choices": ["Milan", "Rome", "Naples", "Turin"], "answer": 1},
    {"country": "Australia", "choices": ["Sydney", "Melbourne", "Canberra", "Perth"], "answer": 2},
    {"country": "Canada", "choices": ["Toronto", "Ottawa", "Montreal", "Vancouver"], "answer": 1},
    {"country": "Turkey", "choices": ["Istanbul", "Izmir", "Antalya", "Ankara"], "answer": 3},
    {"country": "Japan", "choices": ["Osaka", "Tokyo", "Kyoto", "Nagoya"], "answer": 1},
]
GENERATE = [{"country": c, "capital": a} for c, a in
            [("Greece", "Athens"), ("Spain", "Madrid"), ("Egypt", "Cairo"), ("Brazil", "Brasilia"), ("Kenya", "Nairobi"),
             ("Peru", "Lima")]]
MAX_GEN_TOKS = 6
UNTIL = ["\n"]


@pytest.fixture(scope="module")
def server(smollm):
    with http_server(smollm, SERVING_ENGINE, max_tokens_limit=64) as server:
        yield server


def write_tasks(root: Path, cache: Path) -> None:
    """Two lm-eval task YAMLs over JSONL files in `root`: `capitals_mc` scores each choice's log-likelihood,
    `capitals_gen` generates greedily and strips the text."""
    common = {"dataset_path": "json", "test_split": "test", "metadata": {"version": 1},
              "doc_to_text": PROMPT.replace("{country}", "{{country}}")}
    for name, docs, task in [
        ("capitals_mc", MULTIPLE_CHOICE, {
            "output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}),
        ("capitals_gen", GENERATE, {
            "output_type": "generate_until", "doc_to_target": "{{capital}}",
            "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False, "temperature": 0},
            "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}],
            "metric_list": [{"metric": "exact_match"}]}),
    ]:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        spec = {"task": name, **common, **task,
                "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(cache)}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))


def continuation_logprobs(hf_model, hf_tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """log p(continuation | context) of each pair and whether greedy decoding would produce the continuation, from
    transformers' logits (one right-padded batch). The continuation's tokens are those of the whole text after the
    context's, as lm-eval splits a causal model's pair."""
    rows = [(hf_tokenizer(context + continuation, add_special_tokens=False).input_ids,
             len(hf_tokenizer(context, add_special_tokens=False).input_ids)) for context, continuation in pairs]
    width = max(len(ids) for ids, _ in rows)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows]),
                          attention_mask=torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]))
    out = []
    for row, (ids, context_len) in zip(logits.logits, rows):
        logprobs = torch.log_softmax(row[context_len - 1:len(ids) - 1].double(), -1)
        target = torch.tensor(ids[context_len:])
        out.append((float(logprobs[torch.arange(len(target)), target].sum()), bool((logprobs.argmax(-1) == target).all())))
    return out


def greedy_text(hf_model, hf_tokenizer, prompt: str, max_new: int, stops: list[str]) -> str:
    """transformers' greedy continuation of `prompt`, cut before the first stop string (as OpenAI's `stop` does)."""
    ids = hf_tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                pad_token_id=hf_tokenizer.eos_token_id)
    text = hf_tokenizer.decode(out[0, len(ids):], skip_special_tokens=False)
    return text[:min(i for i in [text.find(s) for s in stops] + [len(text)] if i >= 0)]


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer) -> tuple[list[list[tuple[float, bool]]], list[str]]:
    """transformers' answers to both tasks: each document's choices' (log-likelihood, is greedy), and each prompt's
    greedy text. On one torch thread: on a busy two-core machine two threads wait on each other, 5-10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pairs = [(PROMPT.format(country=doc["country"]), " " + c) for doc in MULTIPLE_CHOICE for c in doc["choices"]]
        flat = iter(continuation_logprobs(hf_model, hf_tokenizer, pairs))
        stops = [*UNTIL, hf_tokenizer.eos_token]  # lm-eval adds the tokenizer's end of sequence to `until`
        texts = [greedy_text(hf_model, hf_tokenizer, PROMPT.format(country=doc["country"]), MAX_GEN_TOKS, stops)
                 for doc in GENERATE]
    finally:
        torch.set_num_threads(threads)
    return [[next(flat) for _ in doc["choices"]] for doc in MULTIPLE_CHOICE], texts


def test_lm_eval_scores_equal_the_models_own(server, reference, hf_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    tokenizer_dir = tmp_path / "tokenizer"
    hf_tokenizer.save_pretrained(tokenizer_dir)  # lm-eval splits context and continuation with it
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks, tmp_path / "datasets")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"http://127.0.0.1:{server.http_port}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir), "max_retries": 1},
        tasks=["capitals_mc", "capitals_gen"], task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=4, log_samples=True, bootstrap_iters=0)
    assert out is not None
    choice_refs, text_refs = reference

    samples = sorted(out["samples"]["capitals_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MULTIPLE_CHOICE)
    acc, acc_norm = [], []
    for doc, sample, ref in zip(MULTIPLE_CHOICE, samples, choice_refs):
        got = [tuple(r[0]) for r in sample["resps"]]
        np.testing.assert_allclose([ll for ll, _ in got], [ll for ll, _ in ref], atol=1e-3, err_msg=doc["country"])
        assert [g for _, g in got] == [g for _, g in ref], doc["country"]
        lls = np.array([ll for ll, _ in ref])
        acc.append(float(np.argmax(lls) == doc["answer"]))
        acc_norm.append(float(np.argmax(lls / [len(c) for c in doc["choices"]]) == doc["answer"]))
        assert (sample["acc"], sample["acc_norm"]) == (acc[-1], acc_norm[-1]), doc["country"]
    scores = out["results"]["capitals_mc"]
    assert scores["acc,none"] == pytest.approx(np.mean(acc)) and scores["acc_norm,none"] == pytest.approx(np.mean(acc_norm))

    samples = sorted(out["samples"]["capitals_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(GENERATE)
    for doc, sample, text in zip(GENERATE, samples, text_refs):
        assert sample["resps"] == [[text]] and sample["filtered_resps"] == [text.strip()], doc["country"]
    matches = [text.strip() == doc["capital"] for doc, text in zip(GENERATE, text_refs)]
    assert out["results"]["capitals_gen"]["exact_match,strip"] == pytest.approx(np.mean(matches))
