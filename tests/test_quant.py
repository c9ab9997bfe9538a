"""int8 weights: error bounds, the QuantizedArray through jit, sharding and orbax, loading, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoint import load_model, save_model
from jaxserve.config import QuantConfig
from jaxserve.errors import CheckpointError, JaxserveError
from jaxserve.model.quant import (
    QuantizedArray,
    dequantize,
    embed_lookup,
    linear,
    linear_bytes,
    quantize,
    quantized_abstract,
)
from jaxserve.model.weights import Weights, is_spec
from jaxserve.perplexity import perplexity, window_spans
from tests.helpers import cpu_env, greedy, logits_of
from tests.tiny_models import hf_tiny, write_gguf

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_gguf(path, hf_tiny("llama", hidden_size=128, intermediate_size=256))
    return path


@pytest.mark.parametrize("group_size", [0, 32])
def test_dequantized_weight_is_within_half_a_step(group_size):
    w = RNG.standard_normal((6, 16, 128)).astype(np.float32)  # [heads, head_dim, in], like wo transposed
    w[0, 0, :] = 0.0  # an all-zero channel
    w[1, 1, 5] = 40.0  # an outlier: its channel's (or group's) step grows
    q = quantize(jnp.asarray(w), group_size=group_size)
    assert q.values.dtype == jnp.int8 and q.values.shape == (6, 16, 128)
    assert q.scales.shape == ((1 if group_size == 0 else 128 // 32), 6, 16)
    err = np.abs(np.asarray(dequantize(q)) - w)
    step = np.repeat(np.asarray(q.scales).reshape(-1, 1, 6, 16), 128 // q.scales.shape[0], axis=1).reshape(128, 6, 16)
    assert np.all(err <= np.moveaxis(step, 0, -1) / 2 * (1 + 1e-6))
    assert np.all(err[0, 0, :] == 0.0), "a zero channel stays exactly zero"
    others = np.ones_like(w, bool)
    others[1, 1, :] = False
    assert np.linalg.norm(err[others]) / np.linalg.norm(w[others]) < 0.01


def test_groups_confine_an_outlier():
    w = RNG.standard_normal((8, 256)).astype(np.float32)  # [out, in]
    w[3, 0] = 50.0
    per_channel = np.abs(np.asarray(dequantize(quantize(jnp.asarray(w)))) - w)[3, 128:].max()
    per_group = np.abs(np.asarray(dequantize(quantize(jnp.asarray(w), group_size=64))) - w)[3, 128:].max()
    assert per_group < per_channel / 5


@pytest.mark.parametrize("in_ndim", [1, 2])
def test_linear_on_quantized_matches_the_dequantized_weight_under_jit(in_ndim):
    shape = (96, 4, 32) if in_ndim == 2 else (96, 128)  # wo [embed, heads, head_dim] or w_down [embed, ffn]
    w = jnp.asarray(RNG.standard_normal(shape).astype(np.float32))
    q = quantize(w, in_ndim=in_ndim)
    x = jnp.asarray(RNG.standard_normal((2, 3, *shape[len(shape) - in_ndim:])).astype(np.float32))
    out = jax.jit(linear)(x, q)
    assert out.shape == (2, 3, 96)
    np.testing.assert_allclose(out, linear(x, dequantize(q), in_ndim=in_ndim), rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(out - linear(x, w, in_ndim=in_ndim)) / np.linalg.norm(out) < 0.01
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(treedef, leaves).in_ndim == in_ndim


def test_quantized_embedding_rows():
    table = jnp.asarray(RNG.standard_normal((50, 16)).astype(np.float32))  # [vocab, embed]
    q = quantize(table)  # vocab is the output axis
    tokens = jnp.asarray([[3, 49, 0]])
    rows = embed_lookup(q, tokens, jnp.float32)
    np.testing.assert_allclose(rows, dequantize(q)[tokens], rtol=1e-6)


def test_sharded_quantized_linear_on_fake_cpu_devices():
    """values and scales sharded along their output axis ("ffn") over 4 devices give the unsharded product."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxserve.model.quant import quantize, linear, quantized_abstract
from jaxserve.model.weights import ArraySpec
assert jax.device_count() == 4, jax.devices()
spec = ArraySpec((128, 64), ("ffn", "embed"))
w = jnp.asarray(np.random.default_rng(0).standard_normal(spec.shape), jnp.float32)
q = quantize(w)
rules = {"ffn": "tp"}
mesh = Mesh(np.array(jax.devices()), ("tp",))
def sharding(axes):
    return NamedSharding(mesh, P(*(rules.get(a) for a in axes)))
values = jax.device_put(q.values, sharding(("ffn", "embed")))
scales = jax.device_put(q.scales, sharding(("quant_groups", "ffn")))
qs = type(q)(values, scales, in_ndim=1)
x = jnp.ones((3, 64), jnp.float32)
out = jax.jit(linear)(x, qs)
assert len(values.addressable_shards) == 4 and values.addressable_shards[0].data.shape == (32, 64)
np.testing.assert_allclose(np.asarray(out), np.asarray(linear(x, q)), rtol=1e-6)
print("ok", out.sharding)
"""
    env = cpu_env(4, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_abstract_tree_describes_the_quantized_weights(tiny_path):
    """quantized_abstract (what sharding and orbax restore derive from) matches the quantized arrays, with
    the float weight's logical axes output-first on the values."""
    qcfg = QuantConfig(group_size=32)
    model = load_model(tiny_path, quantize=qcfg)
    specs = quantized_abstract(Weights.abstract(model.config), qcfg)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=is_spec)
    leaves = jax.tree_util.tree_leaves(model.weights)
    assert [s.shape for s in spec_leaves] == [tuple(x.shape) for x in leaves]
    wqkv = specs.layers[0].wqkv
    assert wqkv.values.axes == ("kv_heads", "qkv", "head_dim", "embed")
    assert wqkv.scales.axes == ("quant_groups", "kv_heads", "qkv", "head_dim")
    assert isinstance(model.weights.layers[0].w_down, QuantizedArray) and model.weights.layers[0].w_down.group_size == 32


def test_int8_tiny_model_generates_and_saves_a_standalone_orbax_checkpoint(tiny_path, tmp_path):
    float_model = load_model(tiny_path)
    model = load_model(tiny_path, quantize=QuantConfig())
    assert isinstance(model.weights.layers[0].wqkv, QuantizedArray) and model.quantization == QuantConfig()
    assert isinstance(model.weights.lm_head, QuantizedArray), "the head is quantized by default"
    assert linear_bytes(model.weights) < 0.26 * linear_bytes(float_model.weights) + 4096  # int8 vs float32
    ids = [5, 17, 200, 31, 99, 4, 250, 1]
    logits, reference = logits_of(model, ids), logits_of(float_model, ids)
    assert np.abs(logits - reference).max() < 0.05 * np.abs(reference).max()

    save_model(model, str(tmp_path / "q"))
    restored = load_model(str(tmp_path / "q"))  # no --quantize: it loads as saved
    assert restored.quantization == QuantConfig()
    for a, b in zip(jax.tree_util.tree_leaves(model.weights), jax.tree_util.tree_leaves(restored.weights)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(logits_of(restored, ids), logits)
    assert greedy(restored, [ids], 6) == greedy(model, [ids], 6)
    with pytest.raises(CheckpointError, match="cannot be requantized"):
        load_model(str(tmp_path / "q"), quantize=QuantConfig(group_size=32))
    marker = tmp_path / "q" / "jaxserve_model.json"
    marker.write_text(marker.read_text().replace('"format": 2', '"format": 1'))
    with pytest.raises(CheckpointError, match="format 1, written by an older jaxserve.*jaxserve quantize --model"):
        load_model(str(tmp_path / "q"))


def test_float_head_keeps_the_output_head_float(tiny_path):
    model = load_model(tiny_path, quantize=QuantConfig(head=False))
    assert not isinstance(model.weights.lm_head, QuantizedArray) and not isinstance(model.weights.embed, QuantizedArray)
    assert isinstance(model.weights.layers[1].w_gate_up, QuantizedArray)


def test_bad_quantization_options_say_what_is_wrong(tiny_path):
    with pytest.raises(JaxserveError, match="unknown quantization 'int4'; supported: int8"):
        QuantConfig(mode="int4")
    with pytest.raises(JaxserveError, match="group_size must be 0 .* got 48"):
        QuantConfig(group_size=48)
    with pytest.raises(CheckpointError, match=r"group_size=96 does not divide the weight's input size 128"):
        load_model(tiny_path, quantize=QuantConfig(group_size=96))


def test_window_spans_score_every_token_once():
    for n, context, stride in [(10, 4, 2), (100, 16, 5), (7, 32, 16), (64, 16, 16)]:
        scored = [t for _, end, first in window_spans(n, context, stride) for t in range(first, end)]
        assert len(scored) == len(set(scored))
        spans = window_spans(n, context, stride)
        assert all(end - begin <= context and first > begin for begin, end, first in spans)
        if stride < context:
            assert scored == list(range(1, n))


def test_perplexity_of_one_window_is_the_mean_nll_of_the_logits(tiny_path):
    model = load_model(tiny_path)
    ids = [int(i) for i in RNG.integers(0, 256, 40)]
    logits = logits_of(model, ids)
    logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    nll = -np.mean([float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)])
    result = perplexity(model, ids, context=64, stride=32, attention="reference")
    assert result["tokens"] == 39
    np.testing.assert_allclose(result["perplexity"], np.exp(nll), rtol=1e-4)
    windowed = perplexity(model, ids, context=16, stride=8, attention="reference")
    assert windowed["tokens"] == 39 and windowed["perplexity"] != result["perplexity"]


@pytest.mark.slow
def test_cli_quantize_then_serve_info_and_perplexity_from_the_output_alone(tiny_path, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "jaxserve")
    out = str(tmp_path / "int8")

    def run(*args):
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)

    proc = run("quantize", "--model", tiny_path, "--output", out, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(run("info", "--model", out, "--json").stdout)
    assert info["quantization"]["mode"] == "int8" and info["dtype"] == "float32"
    float_info = json.loads(run("info", "--model", tiny_path, "--json").stdout)
    assert info["parameters"] == float_info["parameters"]
    assert info["linear_bytes"] < 0.26 * float_info["linear_bytes"] + 4096
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    proc = run("perplexity", "--model", out, "--text-file", str(text), "--context", "64", "--stride", "32", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens"] > 100 and result["perplexity"] > 1
    proc = run("info", "--model", tiny_path, "--quantize", "int4")
    assert proc.returncode == 2 and "invalid choice: 'int4'" in proc.stderr
    proc = run("info", "--model", tiny_path, "--quantize", "int8", "--quantize-group-size", "48")
    assert proc.returncode == 2
    assert "group_size must be 0 (per output channel) or a positive multiple of 32, got 48" in proc.stderr


@pytest.mark.slow
def test_int8_embedded_model_greedy_mostly_equals_float(smollm, embedded_path):
    """Free-running greedy texts part ways at the first near-tie, so the share that matters is
    teacher-forced: int8's top token on float32's own greedy text. Measured (benchmarks/int8_cpu.py,
    6 prompts x 32 tokens): see benchmarks/results/int8_cpu.jsonl."""
    from benchmarks.int8_cpu import teacher_forced_agreement

    model = load_model(embedded_path, quantize=QuantConfig())
    prompts = [smollm.tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):",
                                                   "Water boils at", "The first president of the United States was")]
    outs = greedy(smollm, prompts, 16)  # int8 through the engine: see the tiny-model orbax test
    forced = [teacher_forced_agreement(model, p, o) for p, o in zip(prompts, outs)]
    assert np.mean(forced) >= 0.9, (forced, outs)
    assert forced[0] == 1.0 and smollm.tokenizer.decode(outs[0]).startswith(" Paris")


def test_decode_pads_its_rows_once_for_the_kernel_and_writes_only_real_rows():
    """A 3-row decode step through the Mosaic GPU kernel (interpreted) pads its activations to 8 rows once, not
    in every product; the padding rows skip attention (no K/V written) and the step matches XLA's products."""
    import dataclasses

    from jaxserve.checkpoint.random_model import PRESETS
    from jaxserve.model.kv_cache import KVCache
    from jaxserve.model.quant import quantize_weights, with_backend
    from jaxserve.model.transformer import forward
    from jaxserve.model.weights import random_weights

    cfg = PRESETS["smoke"]
    weights = quantize_weights(random_weights(cfg, jax.random.key(0), jnp.float32), QuantConfig(mode="int8"))
    on = {b: with_backend(weights, b) for b in ("pallas", "reference")}
    rows, pages = 3, 2
    cache = KVCache.zeros(cfg, rows * pages, 16, jnp.float32, padding_page=True)
    cache = dataclasses.replace(cache, k=tuple(jnp.asarray(RNG.standard_normal(k.shape), jnp.float32) for k in cache.k))
    tokens = jnp.asarray([[5], [7], [9]], jnp.int32)
    positions = jnp.asarray([[3], [20], [0]], jnp.int32)
    valid = jnp.asarray([[True], [True], [False]])
    table = jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages)

    def step(w):
        return forward(w, cfg, tokens, positions, valid, table, cache, attention="reference")

    kernel_calls = ("pallas_call", "custom_vmap_call")  # the latter: how a Mosaic GPU kernel is interpreted on CPU

    def eqns(jaxpr):  # every equation, into nested jaxprs but not into the kernels
        for e in jaxpr.eqns:
            yield e
            if e.primitive.name not in kernel_calls:
                for value in e.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else (value,):
                        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                            yield from eqns(getattr(sub, "jaxpr", sub))

    found = list(eqns(jax.make_jaxpr(step)(on["pallas"]).jaxpr))
    pads = [e for e in found if e.primitive.name == "pad"]
    kernels = [e for e in found if e.primitive.name in kernel_calls]
    assert len(kernels) == 4 * cfg.num_layers + 1
    assert len(pads) == 1 + cfg.num_layers, "x once, then each layer's attention output back to the padded rows"
    assert all(e.invars[0].aval.shape[0] == 8 for e in kernels)
    out, ref = step(on["pallas"]), step(on["reference"])
    assert out.logits.shape == ref.logits.shape == (rows, 1, cfg.vocab_size)
    assert np.linalg.norm(out.logits - ref.logits) / np.linalg.norm(ref.logits) < 2e-2  # the kernel's bfloat16
    for got, before in zip(out.cache.k + out.cache.v, cache.k + cache.v):
        written = np.argwhere(np.any(np.asarray(got) != np.asarray(before), axis=(0, 3))[:rows * pages])
        assert sorted(map(tuple, written.tolist())) == [(0, 3), (3, 4)]  # the valid rows' slots; the rest untouched
