"""The decode megakernel's reference (pallas_kernels.decode_megakernel.reference) against the model's own decode step:
the same logits and the same K/V written, from weights and pages stacked across the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import QuantConfig
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.quant import embed_lookup, quantize_weights
from jaxserve.model.transformer import forward, normed_linear, rope_inv_freq
from jaxserve.model.weights import random_weights
from pallas_kernels import decode_megakernel
from pallas_kernels.decode_megakernel.reference import decode_layers, stack_layers, stack_pages

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
PAGE = 4


def _model():
    weights = random_weights(CFG, jax.random.PRNGKey(0))
    layers = tuple(layer.__class__(**{**layer.__dict__,  # random norm gains, so a gain left out shows
                                      "attn_norm": 1 + 0.3 * jax.random.normal(jax.random.PRNGKey(i), (CFG.hidden_size,)),
                                      "mlp_norm": 1 - 0.3 * jax.random.normal(jax.random.PRNGKey(9 + i),
                                                                              (CFG.hidden_size,))})
                   for i, layer in enumerate(weights.layers))
    return quantize_weights(weights.__class__(weights.embed, layers, weights.final_norm, weights.lm_head),
                            QuantConfig(mode="int8"))


def test_reference_decode_step_is_the_models():
    """Two rows with their pages in shuffled order, prompts of 5 and 9 tokens (the second crossing pages); then one
    decode step by the model and by the reference on stacked weights and pages: logits and written K/V agree."""
    weights = _model()
    table = np.array([[5, 1, 7, 0], [2, 6, 3, 4]], np.int32)
    cache = KVCache.zeros(CFG, 8, PAGE, jnp.float32)
    lengths = np.array([5, 9], np.int32)
    prompt = np.array(jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, CFG.vocab_size), np.int32)
    positions = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    cache = forward(weights, CFG, jnp.asarray(prompt), jnp.asarray(positions), jnp.asarray(positions < lengths[:, None]),
                    jnp.asarray(table), cache).cache
    token = jnp.asarray([[11], [42]], jnp.int32)
    stacked_k, stacked_v = stack_pages(cache.k), stack_pages(cache.v)  # before the step: the model's writes are next
    out = forward(weights, CFG, token, jnp.asarray(lengths)[:, None], jnp.ones((2, 1), bool), jnp.asarray(table), cache)

    st = stack_layers(CFG, weights.layers, tiles=False)  # (CFG's products are not whole tiles)
    x = embed_lookup(weights.embed, token, jnp.float32)[:, 0]
    h, k_pages, v_pages = decode_layers(CFG, st, x, stacked_k, stacked_v, jnp.asarray(table), jnp.asarray(lengths),
                                        rope_inv_freq(CFG.head_dim, CFG.rope_theta, CFG.rope_scaling), PAGE)
    logits = normed_linear(h, weights.final_norm, weights.lm_head, CFG.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(out.logits[:, 0]), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(k_pages), np.asarray(stack_pages(out.cache.k)), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(v_pages), np.asarray(stack_pages(out.cache.v)), rtol=2e-4, atol=2e-4)
    assert not np.allclose(np.asarray(k_pages), np.asarray(stacked_k))  # the step wrote something


def test_tiled_layers_are_the_row_major_ones():
    """stack_layers' tiles (the kernel's layout) hold the same products as its row-major form: to_tiles and
    from_tiles are inverses, and the reference decodes the same from either, on products of whole tiles."""
    from pallas_kernels.decode_megakernel.reference import from_tiles, to_tiles

    w = jnp.arange(256 * 512).reshape(256, 512)
    tiled = to_tiles(w)
    assert tiled.shape == (4, 128, 256)
    np.testing.assert_array_equal(tiled[1], w[:128, 256:])  # a row tile's second input step, then the next tile
    np.testing.assert_array_equal(tiled[2], w[128:, :256])
    np.testing.assert_array_equal(from_tiles(tiled, 256), w)
    cfg = ModelConfig(vocab_size=97, hidden_size=512, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=128)  # (two input steps where a product's inputs are d)
    weights = quantize_weights(random_weights(cfg, jax.random.PRNGKey(1)), QuantConfig(mode="int8"))
    tiles, rows = stack_layers(cfg, weights.layers), stack_layers(cfg, weights.layers, tiles=False)
    assert [v.shape for v in tiles.values] == [(32, 128, 256), (16, 128, 256), (16, 128, 256), (8, 128, 256)]
    table, lengths = jnp.asarray([[1, 0]], jnp.int32), jnp.asarray([5], jnp.int32)
    pages = jax.random.normal(jax.random.PRNGKey(2), (2 * 2 * 2 * 8, 128))  # [layers · kv heads · pool · page]
    x = jax.random.normal(jax.random.PRNGKey(4), (1, 512))
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    got, want = (decode_layers(cfg, st, x, pages, pages, table, lengths, inv_freq, 8) for st in (tiles, rows))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"weight tiles are \[128, 256\]: layer 0's wqkv is \[128, 64\]"):
        stack_layers(CFG, _model().layers)


def test_stack_layers_refuses_what_the_megakernel_does_not_take():
    weights = _model()
    with pytest.raises(ValueError, match="intermediate_size=96 is not a multiple of 128"):
        stack_layers(ModelConfig(**{**CFG.__dict__, "intermediate_size": 96}), weights.layers)
    grouped = quantize_weights(random_weights(CFG, jax.random.PRNGKey(0)), QuantConfig(mode="int8", group_size=32))
    with pytest.raises(ValueError, match="layer 0's wqkv must be int8 with one scale a channel.*group_size 32"):
        stack_layers(CFG, grouped.layers)
    with pytest.raises(ValueError, match="layer 0's wqkv must be int8 .* got Array"):
        stack_layers(CFG, random_weights(CFG, jax.random.PRNGKey(0)).layers)


LLAMA_8B_2 = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0)  # the kernel's shapes, two layers


def _stacked_inputs(cfg, length: int, page_size: int, abstract: bool = False, tiles: bool = True):
    """Random stacked int8 layers and bfloat16 pages for the kernel: (st, x, k_pages, v_pages, table, lengths);
    K an eighth of V's size, so that the cached scores are O(1) and a key more or less shows. `abstract`: shapes only.
    `tiles`: the weights as stack_layers' tiles (else row-major)."""
    from jax import ShapeDtypeStruct as Spec

    from pallas_kernels.decode_megakernel.mosaic_gpu import layer_products
    from pallas_kernels.decode_megakernel.reference import PRODUCTS, TILE, StackedLayers, to_tiles

    layers, shapes = cfg.num_layers, layer_products(cfg)
    pages = -(-(length + 1) // page_size)
    pool = 2 * pages
    rows = layers * cfg.num_kv_heads * pool * page_size
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    if abstract:
        values = [Spec((layers * shapes[n][0] * shapes[n][1] // (TILE[0] * TILE[1]), *TILE) if tiles else
                       (layers * shapes[n][0], shapes[n][1]), jnp.int8) for n in PRODUCTS]
        scales = [Spec((layers * shapes[n][0],), jnp.float32) for n in PRODUCTS]
        return (StackedLayers(tuple(values), tuple(scales), Spec((layers, 2, cfg.hidden_size), jnp.float32)),
                Spec((1, cfg.hidden_size), jnp.float32), Spec((rows, cfg.head_dim), jnp.bfloat16),
                Spec((rows, cfg.head_dim), jnp.bfloat16), Spec((1, pages), jnp.int32), Spec((1,), jnp.int32))
    values = [jax.random.randint(next(keys), (layers * shapes[n][0], shapes[n][1]), -127, 128, jnp.int32
                                 ).astype(jnp.int8) for n in PRODUCTS]
    values = [to_tiles(v) if tiles else v for v in values]  # (layer-major either way: a layer's tiles are its rows')
    scales = [jax.random.uniform(next(keys), (layers * shapes[n][0],), jnp.float32, 1e-3, 2e-3) for n in PRODUCTS]
    gains = jax.random.uniform(next(keys), (layers, 2, cfg.hidden_size), jnp.float32, 0.5, 2.0)
    k_pages, v_pages = [(jax.random.normal(next(keys), (rows, cfg.head_dim)) * size).astype(jnp.bfloat16)
                        for size in (0.125, 1.0)]
    table = jnp.asarray(np.random.RandomState(0).permutation(pool)[:pages][None], jnp.int32)
    x = jax.random.normal(next(keys), (1, cfg.hidden_size), jnp.float32)
    return (StackedLayers(tuple(values), tuple(scales), gains), x, k_pages, v_pages, table,
            jnp.asarray([length], jnp.int32))


def test_megakernel_lowers_for_the_gpu():
    """The Mosaic GPU megakernel builds and lowers for CUDA (no GPU needed: shapes only), and refuses by name more
    than one row, weights stacked row-major, and more programs than gate_up's runs can sum a row's squares over."""
    from pallas_kernels.decode_megakernel import mosaic_gpu
    from pallas_kernels.decode_megakernel.plan import Config

    cfg = ModelConfig(**{**LLAMA_8B_2.__dict__, "num_layers": 1})
    st, x, k_pages, v_pages, table, lengths = _stacked_inputs(cfg, 200, 16, abstract=True)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    fn = jax.jit(lambda *a: mosaic_gpu.decode_layers(cfg, *a, inv_freq, 16))
    fn.trace(st, x, k_pages, v_pages, table, lengths).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match=r"one row: x must be \[1, 4096\], got \(2, 4096\)"):
        mosaic_gpu.decode_layers(cfg, st, jax.ShapeDtypeStruct((2, 4096), jnp.float32), k_pages, v_pages, table,
                                 lengths, inv_freq, 16)
    row_major = _stacked_inputs(cfg, 200, 16, abstract=True, tiles=False)[0]
    with pytest.raises(ValueError, match=r"weight tiles .*got a weight of shape \[6144, 4096\]"):
        mosaic_gpu.decode_layers(cfg, row_major, x, k_pages, v_pages, table, lengths, inv_freq, 16)
    with pytest.raises(ValueError, match="runs of 14 units at 256 programs are shorter"):
        Config(model=cfg, layers=1, programs=256, page_size=16, pool=26)


def test_megakernel_names_the_models_and_pages_it_does_not_take(smollm):
    """check_config (what the engine runs at start-up with decode_megakernel on a GPU) takes the 8B shapes at 16-
    and 128-position pages and refuses by name the embedded model's 64-wide heads and pages that do not divide a
    K/V block."""
    from pallas_kernels.decode_megakernel.mosaic_gpu import check_config

    for page_size in (8, 16, 128):
        check_config(LLAMA_8B_2, page_size)
    with pytest.raises(ValueError, match="takes head_dim 128 .*, got 64"):
        decode_megakernel.check_config(smollm.config, 16, jnp.bfloat16, backend="mosaic_gpu")
    decode_megakernel.check_config(smollm.config, 24, jnp.float8_e4m3fn, backend="reference")  # (it takes any)
    with pytest.raises(ValueError, match="reads bfloat16 K/V pages, got float8_e4m3fn"):
        check_config(LLAMA_8B_2, 16, jnp.float8_e4m3fn)
    for page_size in (24, 256, 12):
        with pytest.raises(ValueError, match=f"divides 128, got page_size={page_size}"):
            check_config(LLAMA_8B_2, page_size)
    with pytest.raises(ValueError, match=r"w_gate_up is \[28736, 4096\]"):
        check_config(ModelConfig(**{**LLAMA_8B_2.__dict__, "intermediate_size": 14368}), 16)
    with pytest.raises(ValueError, match="num_heads must be at most 132 .*, got 160 and 8"):
        check_config(ModelConfig(**{**LLAMA_8B_2.__dict__, "num_heads": 160, "hidden_size": 20480}), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("length,page_size", [(200, 16), (256, 128)])
def test_megakernel_is_the_reference_on_the_gpu(length, page_size):
    """Two 8B-shaped layers by the kernel and by reference.decode_layers, on random int8 weights (stack_layers'
    tiles) and pages: the layers' output and every K/V page (the new token's written) agree; a partial last block at
    200 positions."""
    from pallas_kernels.decode_megakernel import mosaic_gpu, reference

    assert jax.default_backend() == "gpu"
    cfg = LLAMA_8B_2
    st, x, k_pages, v_pages, table, lengths = _stacked_inputs(cfg, length, page_size)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: reference.decode_layers(cfg, *a, inv_freq, page_size))(
            st, x, k_pages, v_pages, table, lengths)
    got = jax.jit(lambda *a: mosaic_gpu.decode_layers(cfg, *a, inv_freq, page_size))(
        st, x, k_pages, v_pages, table, lengths)
    for name, g, w in zip(("h", "K pages", "V pages"), got, want):
        g, w = np.asarray(g, np.float64), np.asarray(jnp.asarray(w, jnp.float32), np.float64)
        error = np.abs(g - w).max() / np.abs(w).max()
        assert error < 3e-2, f"{name}: {error:.2e}"  # (bfloat16 q and P in the kernel, float32 in the reference)
    assert not np.array_equal(np.asarray(got[1]), np.asarray(k_pages))  # the new token's K was written


def test_model_decode_through_the_stacked_layers_is_forward():
    """jaxserve.model.transformer.decode_stacked (the reference backend on CPU) against forward at batch 1: the
    same logits and the same K/V written, after a prompt of 6 tokens that crosses a page."""
    from jaxserve.model.transformer import decode_stacked

    weights = _model()
    table = np.array([[3, 0, 6]], np.int32)
    cache = KVCache.zeros(CFG, 8, PAGE, jnp.float32)
    prompt = jax.random.randint(jax.random.PRNGKey(5), (1, 6), 0, CFG.vocab_size)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    cache = forward(weights, CFG, prompt, positions, jnp.ones((1, 6), bool), jnp.asarray(table), cache).cache
    token, lengths = jnp.asarray([[7]], jnp.int32), jnp.asarray([6], jnp.int32)
    out = forward(weights, CFG, token, lengths[:, None], jnp.ones((1, 1), bool), jnp.asarray(table), cache)
    logits, k_pages, v_pages = decode_stacked(weights, stack_layers(CFG, weights.layers, tiles=False), CFG, token, lengths,
                                              jnp.asarray(table), stack_pages(cache.k), stack_pages(cache.v), PAGE,
                                              backend="reference")
    np.testing.assert_allclose(np.asarray(logits), np.asarray(out.logits[:, 0]), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(k_pages), np.asarray(stack_pages(out.cache.k)), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(v_pages), np.asarray(stack_pages(out.cache.v)), rtol=2e-4, atol=2e-4)


def test_engine_decoding_through_the_megakernel_generates_what_it_generates_without(smollm):
    """EngineConfig.decode_megakernel (on CPU its jnp reference, the pages stacked, prefill on per-layer views of
    them): the same greedy tokens as the engine's own decode, over prompts that cross pages and a preemption-free
    run of one slot; a config it cannot serve is refused by name."""
    from jaxserve.checkpoint import LoadedModel
    from jaxserve.config import EngineConfig, SamplingParams
    from jaxserve.errors import JaxserveError
    from jaxserve.runner import build_engine

    cfg = ModelConfig(vocab_size=smollm.config.vocab_size, hidden_size=64, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
    model = LoadedModel(cfg, quantize_weights(random_weights(cfg, jax.random.key(7)), QuantConfig(mode="int8")),
                        smollm.tokenizer, "small-random-int8")
    engine_cfg = EngineConfig(max_slots=1, page_size=8, num_pages=12, max_pages_per_slot=12, chunk_buckets=(16,))
    prompts = [[int(t) for t in np.random.RandomState(s).randint(100, 40000, n)] for s, n in ((0, 5), (1, 21))]
    params = [SamplingParams(max_tokens=14, ignore_eos=True)] * len(prompts)
    want = [r.output_ids for r in build_engine(model, engine_cfg).generate(prompts, params)]
    mega = build_engine(model, EngineConfig(**{**engine_cfg.__dict__, "decode_megakernel": True}))
    assert [r.output_ids for r in mega.generate(prompts, params)] == want
    with pytest.raises(JaxserveError, match="decode_megakernel must be true or false, got 'yes'"):
        EngineConfig(**{**engine_cfg.__dict__, "decode_megakernel": "yes"})
    with pytest.raises(JaxserveError, match="max_slots must be 1 \\(got 2\\)"):
        EngineConfig(**{**engine_cfg.__dict__, "max_slots": 2, "decode_megakernel": True})
    with pytest.raises(JaxserveError, match="decode_megakernel: layer 0's wqkv must be int8"):
        build_engine(LoadedModel(cfg, random_weights(cfg, jax.random.key(7)), smollm.tokenizer, "float"),
                     EngineConfig(**{**engine_cfg.__dict__, "decode_megakernel": True}))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_engine_decodes_through_the_megakernel_on_the_gpu(tmp_path_factory, page_size):
    """The engine's decode_megakernel mode on the chip, its set-up included (the layers and pools stacked, the
    buckets compiled, prefill on per-layer views of the pools): two 8B-shaped layers of random int8 weights, two
    prompts, the first crossing 16-position pages. Every token it generates is the served int8 model's greedy token
    for the same sequence (its forward over prompt and tokens at once), to the kernel's tolerance: the kernel reads
    the K/V that prefill and its own earlier steps wrote."""
    from jaxserve.checkpoint import LoadedModel, load_model
    from jaxserve.config import EngineConfig, SamplingParams
    from jaxserve.runner import build_engine
    from tests.tiny_models import hf_tiny, write_gguf

    assert jax.default_backend() == "gpu"
    path = str(tmp_path_factory.mktemp("tokenizer") / "tiny.gguf")
    write_gguf(path, hf_tiny("llama"))
    tokenizer = load_model(path, dtype="float32").tokenizer  # (its byte vocabulary: 260 tokens)
    cfg = ModelConfig(**{**LLAMA_8B_2.__dict__, "vocab_size": 260, "max_position_embeddings": 1024})
    weights = quantize_weights(random_weights(cfg, jax.random.PRNGKey(3), jnp.bfloat16), QuantConfig(mode="int8"),
                               jnp.bfloat16)
    model = LoadedModel(cfg, weights, tokenizer, "8B-shaped-2-layers-int8")
    engine = build_engine(model, EngineConfig(max_slots=1, page_size=page_size, num_pages=8, max_pages_per_slot=4,
                                              chunk_buckets=(32,), decode_megakernel=True))
    prompts = [[int(t) for t in np.random.RandomState(s).randint(0, 256, n)] for s, n in ((0, 21), (1, 5))]
    new = 12
    outputs = [r.output_ids for r in engine.generate(prompts, [SamplingParams(max_tokens=new, ignore_eos=True)] * 2)]
    for prompt, out in zip(prompts, outputs):
        assert len(out) == new
        seq = jnp.asarray([prompt + out[:-1]], jnp.int32)
        cache = KVCache.zeros(cfg, 4, page_size, jnp.bfloat16)
        logits = forward(weights, cfg, seq, jnp.arange(seq.shape[1], dtype=jnp.int32)[None],
                         jnp.ones(seq.shape, bool), jnp.arange(4, dtype=jnp.int32)[None], cache).logits[0]
        rows = np.asarray(logits[len(prompt) - 1:], np.float64)  # each generated token's row
        short = rows.max(axis=1) - rows[np.arange(new), out]  # how far below the row's greedy logit each token is
        assert (short <= 3e-2 * np.abs(rows).max(axis=1)).all(), (out, short, rows.argmax(axis=1))
