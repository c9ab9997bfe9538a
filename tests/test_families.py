"""Every model family against transformers: a small random model of the family's real structural options (GQA, a
sliding window shorter than the sequence, soft-capping, 8 experts routed top-2, LongRoPE) saved by transformers and
loaded by jaxserve: each layer's input and the logits in float32, then 32 greedy tokens through the engine (paged KV
in pages of 4, prefill in chunks of 8, two prompts sharing a prefix longer than the window)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from jaxserve.checkpoint import load_model
from jaxserve.config import SamplingParams
from tests.helpers import full_forward, run_engine
from tests.tiny_models import hf_tiny, save_tiny

WINDOW = 8
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(8)],
            "long_factor": [1.5 + 0.7 * i for i in range(8)]}
# model_type, transformers config overrides, and switches that each break the match when turned off
FAMILIES = {
    "qwen3": ("qwen3", {"head_dim": 16}, [{"qk_norm": False}]),
    "mistral": ("mistral", {"sliding_window": WINDOW}, [{"sliding_window": None}]),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
              [{"local_layers": None}]),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "initializer_range": 0.1,
                          "attn_logit_softcapping": 0.5, "final_logit_softcapping": 0.4},
               [{"attn_softcap": None}, {"final_softcap": None}, {"sliding_window": None, "local_layers": None}]),
    "gemma3": ("gemma3_text", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": WINDOW,
                               "sliding_window_pattern": 3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
               [{"local_rope_theta": None}, {"qk_norm": False}, {"sliding_window": None, "local_layers": None}]),
    # every position below original_max_position_embeddings: the short factors (the long: test_longrope_...)
    "phi3": ("phi3", {"pad_token_id": 0, "sliding_window": 6, "original_max_position_embeddings": 64,
                      "max_position_embeddings": 256, "rope_scaling": LONGROPE},
             [{"rope_scaling": None}, {"sliding_window": None}]),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}, [{"norm_topk_prob": False}]),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "head_dim": 16}, [{"norm_topk_prob": True}]),
}
MAX_REL_ERR = 1e-4


def max_rel_err(ours, ref) -> float:
    ref = np.asarray(ref)
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the transformers model, jaxserve's load of what it saved)."""
    model_type, overrides, _ = FAMILIES[request.param]
    torch.set_num_threads(2)
    hf = hf_tiny(model_type, **overrides)
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny(hf, directory)
    return request.param, hf, load_model(str(directory), dtype="float32")


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def test_hidden_states_and_logits_match_transformers(family):
    """Each layer's input and the logits of a 3 x WINDOW sequence; with any of the family's switches turned off,
    the logits differ."""
    name, hf, model = family
    ids = prompt(1, 3 * WINDOW)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    out = full_forward(model, ids, return_hidden=True)
    assert len(out.hidden_states) == model.config.num_layers
    for i, ours in enumerate(out.hidden_states):
        assert max_rel_err(ours, ref.hidden_states[i]) <= MAX_REL_ERR, f"input of layer {i}"
    assert max_rel_err(out.logits, ref.logits) <= MAX_REL_ERR
    for off in FAMILIES[name][2]:
        changed = dataclasses.replace(model, config=dataclasses.replace(model.config, **off))
        assert max_rel_err(full_forward(changed, ids).logits, ref.logits) > 10 * MAX_REL_ERR, f"{off} changes nothing"


def test_engine_generates_the_greedy_tokens_of_transformers(family):
    """32 greedy tokens of two prompts sharing a prefix longer than the window, through the engine: pages of 4
    tokens, prefill chunks of 8, the second prompt's prefix pages taken from the first's (one slot: one decode
    bucket to compile, the prompts one after the other)."""
    name, hf, model = family
    window = model.config.sliding_window or WINDOW
    shared = prompt(2, window + 5)
    prompts = [shared + prompt(3, 3), shared + prompt(4, 2)]
    done = run_engine(model, prompts, SamplingParams(max_tokens=32, ignore_eos=True), page_size=4, chunk_sizes=(8,),
                      max_slots=1)
    for p, r in zip(prompts, done):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert r.output_ids == expected[0, len(p):].tolist(), f"prompt of {len(p)} tokens"
    assert max(r.cached_tokens for r in done) >= 4 * (len(shared) // 4) > window


def test_longrope_takes_the_long_factors_from_the_original_length():
    """Phi-3's LongRoPE: positions from original_max_position_embeddings on rotate by the long factors, times the
    attention factor, as transformers' rotary embedding does for a sequence that long. (transformers then rotates
    every earlier position by them too, recomputing the cache; jaxserve's pages keep each position as it was
    written, so a sequence that crosses the length attends a little differently to the positions before it.)"""
    import jax.numpy as jnp

    from jaxserve.checkpoint.hf_config import config_from_hf
    from jaxserve.model.transformer import apply_rope, rope_inv_freq

    _, overrides, _ = FAMILIES["phi3"]
    hf = hf_tiny("phi3", **overrides)
    cfg = config_from_hf(hf.config.to_dict())
    positions = torch.arange(60, 72)[None]  # across original_max_position_embeddings = 64
    x = torch.randn(1, 1, 12, cfg.head_dim)  # [b, heads, t, hd]
    cos, sin = hf.model.rotary_emb(x, positions)
    half = cfg.head_dim // 2
    expected = x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]
    ours = apply_rope(jnp.asarray(x.numpy()).transpose(0, 2, 1, 3), jnp.asarray(positions.numpy()),
                      rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), cfg.rope_scaling)
    ours = np.asarray(ours).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(ours[..., 4:, :], expected[..., 4:, :].numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(ours[..., :4, :] - expected[..., :4, :].numpy()).max() > 1e-2  # below 64: the short factors
    assert cfg.rope_scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))


def test_info_json_reports_the_architecture_and_its_switches(tmp_path):
    from tests.test_cli import jaxserve

    _, overrides, _ = FAMILIES["gemma2"]
    save_tiny(hf_tiny("gemma2", **overrides), tmp_path)
    proc = jaxserve("info", "--json", "--model", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "gemma2"
    assert info["switches"] == {"sliding_window": WINDOW, "local_layers": [0], "activation": "gelu_tanh",
                                "embed_scale": True, "sandwich_norm": True, "query_pre_attn_scalar": 24.0,
                                "attn_softcap": 0.5, "final_softcap": 0.4}


@pytest.mark.parametrize("width", [1, 24], ids=["decode", "prefill"])
def test_the_model_attention_passes_its_spec_to_the_kernels(width):
    """The model's one attention call (jaxserve.model.attention.attend) with a layer's scale, soft-cap and window:
    the interpreted Mosaic GPU kernels (decode, and a prefill chunk after 40 cached positions) give XLA's output."""
    import jax.numpy as jnp

    from jaxserve.model.attention import AttentionSpec, attend

    spec = AttentionSpec(sm_scale=0.3, softcap=0.8, window=WINDOW + 3)
    rng = np.random.default_rng(width)
    q = jnp.asarray(rng.standard_normal((2, width, 4, 64), np.float32))
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((2, 6, 16, 64), np.float32)) for _ in range(2))
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 3, 2]], jnp.int32)
    positions = jnp.asarray(40 + np.arange(width)[None].repeat(2, 0), jnp.int32)
    valid = jnp.ones((2, width), bool)
    xla = attend(q, k_pages, v_pages, table, positions, valid, backend="reference", spec=spec)
    kernels = attend(q, k_pages, v_pages, table, positions, valid, backend="mosaic_gpu", spec=spec)
    assert float(jnp.max(jnp.abs(kernels - xla))) < 0.05  # the kernel's bfloat16 operands
    plain = attend(q, k_pages, v_pages, table, positions, valid, backend="reference")
    assert float(jnp.max(jnp.abs(plain - xla))) > 0.2


@pytest.mark.skipif(len(__import__("jax").devices()) < 8, reason="needs 8 devices (XLA_FLAGS, see tests/conftest.py)")
def test_tensor_and_expert_parallel_engine_generates_the_tokens_of_one_device(tmp_path):
    """Qwen3-MoE's 8 experts over ep=4 devices, each expert's ffn and the heads over tp=2: the greedy tokens of
    transformers (which the one-device engine gives, above); the experts' weights are laid out as the rules say."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.config import ParallelConfig
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.parallel.sharding import weight_shardings

    model_type, overrides, _ = FAMILIES["qwen3_moe"]
    hf = hf_tiny(model_type, **overrides)
    save_tiny(hf, tmp_path)
    model = load_model(str(tmp_path), dtype="float32")
    layer = weight_shardings(model.weights, model.config, make_mesh(ParallelConfig(tp=2, ep=4))).layers[0]
    assert (layer.experts.gate_up.spec, layer.experts.down.spec) == (P("expert", "model", None, None),
                                                                     P("expert", None, "model"))
    assert layer.experts.router.spec == P(None, None) and layer.wqkv.spec == P("model", None, None, None)
    ids = prompt(7, 11)
    [done] = run_engine(model, [ids], SamplingParams(max_tokens=12, ignore_eos=True), page_size=4, chunk_sizes=(8,),
                        parallel=ParallelConfig(tp=2, ep=4))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert done.output_ids == expected[0, len(ids):].tolist()


def test_parallel_layouts_the_model_cannot_take_are_refused_by_name():
    from jaxserve.config import ParallelConfig
    from jaxserve.errors import JaxserveError
    from jaxserve.model.config import ModelConfig
    from jaxserve.parallel.mesh import check_model

    moe = ModelConfig(architecture="mixtral", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, experts_per_token=2,
                      moe_intermediate_size=32)
    check_model(moe, ParallelConfig(tp=2, ep=4))
    with pytest.raises(JaxserveError, match=r"--ep 3 does not divide the model's 8 experts \(mixtral\); use an ep "
                                            r"among \[1, 2, 4, 8\]"):
        check_model(moe, ParallelConfig(ep=3))
    dense = dataclasses.replace(moe, architecture="llama", num_experts=0, experts_per_token=0, moe_intermediate_size=0)
    with pytest.raises(JaxserveError, match="--ep 2: this llama model has no experts to split; use ep 1"):
        check_model(dense, ParallelConfig(ep=2))
    with pytest.raises(JaxserveError, match="--sp 2: ring attention takes no sliding window"):
        check_model(dataclasses.replace(dense, sliding_window=4), ParallelConfig(sp=2))


def test_random_presets_have_the_families_shapes_and_a_decode_step_reads_the_routed_experts():
    """random:qwen3-8b, gemma3-12b and qwen3-30b-a3b (for speed work) have their parameter counts; a batch-1 decode
    step of a mixture reads experts_per_token of its experts' bytes, and the head but one row of the embedding."""
    import math

    import jax

    from jaxserve.checkpoint.random_model import PRESETS
    from jaxserve.model.quant import decode_weight_bytes
    from jaxserve.model.weights import Weights, is_spec, param_bytes

    def params(name: str) -> float:
        specs = jax.tree_util.tree_leaves(Weights.abstract(PRESETS[name]), is_leaf=is_spec)
        return sum(math.prod(s.shape) for s in specs) / 1e9

    assert (round(params("qwen3-8b"), 2), round(params("gemma3-12b"), 2), round(params("qwen3-30b-a3b"), 2)) == \
        (8.19, 11.77, 30.53)
    cfg = dataclasses.replace(PRESETS["qwen3-30b-a3b"], vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, num_experts=8, experts_per_token=2, moe_intermediate_size=16)
    w = jax.tree_util.tree_map(lambda spec: np.zeros(spec.shape, np.float32), Weights.abstract(cfg), is_leaf=is_spec)
    experts = sum(lw.experts.gate_up.nbytes + lw.experts.down.nbytes for lw in w.layers)
    assert decode_weight_bytes(w, 2) == param_bytes(w) - w.embed.nbytes + 32 * 4 - experts * 6 // 8
    assert decode_weight_bytes(w, 2, rows=4) == param_bytes(w) - w.embed.nbytes + 4 * 32 * 4


def test_the_decode_megakernel_refuses_a_model_with_switches_it_does_not_run():
    from jaxserve.checkpoint.random_model import PRESETS
    from jaxserve.model.transformer import decode_stacked

    with pytest.raises(ValueError, match=r"runs Llama's block; this qwen3 model turns on \{'qk_norm': True\}"):
        decode_stacked(None, None, PRESETS["qwen3-8b"], None, None, None, None, None, 16)  # type: ignore[arg-type]
