"""Meshes, sharding rules, ring attention and the sharded forward, on fake CPU devices (tests/conftest.py)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.config import DistributedConfig, EngineConfig, ParallelConfig, QuantConfig
from jaxserve.engine.batch import StepInput
from jaxserve.engine.pages import PageAllocator
from jaxserve.errors import JaxserveError
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.quant import quantize_weights
from jaxserve.model.transformer import forward
from jaxserve.model.weights import random_weights
from jaxserve.parallel import distributed, lockstep, sharding
from jaxserve.parallel.mesh import MeshPlan, make_mesh
from jaxserve.parallel.ring import ring_attention, ring_attention_sharded, zigzag_order
from pallas_kernels.flash_attention.reference import flash_attention

needs_12 = pytest.mark.skipif(jax.device_count() < 12, reason="needs 12 devices (XLA_FLAGS, see tests/conftest.py)")

TINY = ModelConfig(vocab_size=513, hidden_size=72, intermediate_size=96, num_layers=2, num_heads=9, num_kv_heads=3,
                   head_dim=8, max_position_embeddings=256)


# -- rules and meshes -----------------------------------------------------------------------------
@needs_12
def test_rules_shard_heads_ffn_vocab_over_model_and_reject_collisions():
    mesh = make_mesh(ParallelConfig(tp=3, sp=4))
    assert dict(mesh.shape) == {"data": 1, "seq": 4, "expert": 1, "model": 3}
    shardings = sharding.weight_shardings(random_weights(TINY, jax.random.key(0)), TINY, mesh)
    layer = shardings.layers[0]
    assert layer.wqkv.spec == P("model", None, None, None) and layer.wo.spec == P(None, "model", None)
    assert layer.w_gate_up.spec == P("model", None, None) and layer.w_down.spec == P(None, "model")
    assert shardings.embed.spec == P("model", None) and layer.attn_norm.spec == P(None)
    assert sharding.logical_spec(sharding.CACHE_AXES, (3, 16, 4, 8), mesh) == P("model", "seq", None, None)
    assert sharding.logical_spec(("ffn",), (97,), mesh) == P(None)  # 3 does not divide 97: kept whole
    clashing = [*sharding.RULES[:1], ("embed", "model"), *sharding.RULES[2:]]
    with pytest.raises(ValueError, match=r"\['vocab', 'embed'\].*'model'"):
        sharding.logical_spec(("vocab", "embed"), (513, 72), mesh, clashing)
    with pytest.raises(ValueError, match="mesh axes \\['tensor'\\]"):
        sharding.check_rules([("vocab", "tensor")], mesh.axis_names)


@needs_12
def test_quantized_weights_shard_values_like_the_float_weight_and_scales_on_its_output_axes():
    mesh = make_mesh(ParallelConfig(tp=3))
    weights = quantize_weights(random_weights(TINY, jax.random.key(0)), QuantConfig(mode="int8"))
    layer = sharding.weight_shardings(weights, TINY, mesh).layers[0]
    assert layer.wqkv.values.spec == P("model", None, None, None)
    assert layer.wqkv.scales.spec == P(None, "model", None, None)
    assert layer.wo.values.spec == P(None, "model", None) and layer.wo.scales.spec == P(None, None)
    assert layer.w_down.values.spec == P(None, "model") and layer.w_down.scales.spec == P(None, None)
    placed = sharding.shard_weights(weights, TINY, mesh)
    assert placed.layers[0].wqkv.values.sharding.shard_shape((3, 5, 8, 72)) == (1, 5, 8, 72)


@needs_12
def test_mesh_and_head_errors_name_the_values():
    with pytest.raises(JaxserveError, match="needs 24 devices, but only 12"):
        make_mesh(ParallelConfig(tp=3, sp=8))
    engine = EngineConfig(num_pages=16, max_pages_per_slot=4, chunk_buckets=(16,), parallel=ParallelConfig(tp=2))
    with pytest.raises(JaxserveError, match=r"--tp 2 does not divide the model's 9 query heads; use a tp among \[1, 3, 9\]"):
        MeshPlan.build(TINY, random_weights(TINY, jax.random.key(0)), engine)
    with pytest.raises(JaxserveError, match="num_pages=10 must be a multiple of sp=4"):
        EngineConfig(num_pages=10, max_pages_per_slot=4, chunk_buckets=(16,), parallel=ParallelConfig(sp=4))
    with pytest.raises(JaxserveError, match=r"chunk_buckets=\(12,\) must be multiples of 2 \* sp=8"):
        EngineConfig(num_pages=16, max_pages_per_slot=4, chunk_buckets=(12,), parallel=ParallelConfig(sp=4))


def test_kv_heads_are_repeated_when_tp_exceeds_them():
    weights = random_weights(TINY, jax.random.key(0))
    repeated, cfg = sharding.replicate_kv_heads(weights, TINY, 9)
    before, after = weights.layers[0].wqkv, repeated.layers[0].wqkv  # [3, 3 + 2, 8, 72] -> [9, 1 + 2, 8, 72]
    assert cfg.num_kv_heads == 9 and after.shape == (9, 3, 8, 72)
    # query head 4 (the old KV head 1's second) is now the only query head of KV head 4, a copy of the old head 1
    np.testing.assert_array_equal(after[4, 0], before[1, 1])
    np.testing.assert_array_equal(after[4, 1:], before[1, 3:])
    quantized = quantize_weights(weights, QuantConfig(mode="int8"))
    repeated_q = sharding.replicate_kv_heads(quantized, TINY, 9)[0].layers[0].wqkv
    assert repeated_q.values.shape == (9, 3, 8, 72) and repeated_q.scales.shape == (1, 9, 3, 8)
    np.testing.assert_array_equal(repeated_q.scales[0, 4, 1:], quantized.layers[0].wqkv.scales[0, 1, 3:])
    assert sharding.kv_heads_for(4, 6) == 12 and sharding.kv_heads_for(8, 4) == 8


# -- host side -------------------------------------------------------------------------------------
def test_pages_are_striped_over_shards_and_cached_prefixes_keep_their_stripe():
    pool = PageAllocator(num_pages=8, page_size=4, shards=4)
    pages = [pool.allocate(i) for i in range(6)]
    assert [p // 2 for p in pages] == [0, 1, 2, 3, 0, 1]  # page i lies in block i % 4
    assert pool.allocate(4) is None  # block 0 is full although others are not
    pool.register(pages[1], 123)
    for p in pages:
        pool.release(p)
    assert pool.lookup(123) == pages[1]
    pool.check()


def test_distributed_settings_come_from_flags_then_jaxserve_then_leaderworkerset_env():
    lws = {"LWS_LEADER_ADDRESS": "group-0.svc", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}
    assert distributed.resolve(DistributedConfig(), lws) == DistributedConfig(
        coordinator_address="group-0.svc:8476", num_processes=4, process_id=2)
    env = {**lws, "JAXSERVE_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAXSERVE_PROCESS_ID": "3"}
    assert distributed.resolve(DistributedConfig(process_id=1), env) == DistributedConfig(
        coordinator_address="10.0.0.1:1234", num_processes=4, process_id=1)
    assert distributed.initialize(DistributedConfig(), {}) is False  # one process: nothing to join
    with pytest.raises(JaxserveError, match="JAXSERVE_NUM_PROCESSES='two' must be an integer"):
        distributed.resolve(DistributedConfig(), {"JAXSERVE_NUM_PROCESSES": "two"})
    with pytest.raises(JaxserveError, match="needs coordinator_address"):
        distributed.initialize(DistributedConfig(num_processes=2, process_id=0), {})
    with pytest.raises(JaxserveError, match="process_id=4 must be below num_processes=4"):
        distributed.resolve(DistributedConfig(), {**lws, "LWS_WORKER_INDEX": "4"})


def test_step_inputs_survive_the_lockstep_packing():
    inp = StepInput.build([None, None], 16, 4, 8)
    inp.tokens[:] = np.arange(32).reshape(2, 16)
    inp.valid[0, :5] = True
    inp.temperature[:] = [0.7, 1.5]
    inp.seeds[:] = [2**32 - 1, 7]
    back = lockstep.unpack(lockstep.pack(inp), inp.shape, 8)
    for name, x in vars(inp).items():
        np.testing.assert_array_equal(getattr(back, name), x, err_msg=name)
        assert getattr(back, name).dtype == x.dtype


# -- ring attention and the sharded forward ----------------------------------------------------------
@needs_12
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [37, 5])
def test_ring_attention_equals_the_reference(causal, length):
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    kq, kk, kv = jax.random.split(jax.random.key(length), 3)
    q = jax.random.normal(kq, (2, length, 6, 16))
    k, v = jax.random.normal(kk, (2, length, 2, 16)), jax.random.normal(kv, (2, length, 2, 16))
    out = ring_attention(q, k, v, mesh=mesh, causal=causal)
    np.testing.assert_allclose(out, flash_attention(q, k, v, causal=causal), atol=2e-6, rtol=1e-5)


@needs_12
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_ring_attention_equals_the_reference(causal):
    """Blocks of 8 keys in tiles of 4: tiles above a diagonal are skipped, the rest merge online."""
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(kq, (1, 64, 4, 16))
    k, v = jax.random.normal(kk, (1, 64, 2, 16)), jax.random.normal(kv, (1, 64, 2, 16))
    order = zigzag_order(64, 4) if causal else np.arange(64)
    pos = jnp.asarray(order, jnp.int32)[None]
    ring = jax.jit(ring_attention_sharded(mesh, causal=causal, tile=4))  # as the engine's step runs it
    out = ring(q[:, order], k[:, order], v[:, order], pos, pos < 64)[:, np.argsort(order)]
    np.testing.assert_allclose(out, flash_attention(q, k, v, causal=causal), atol=2e-6, rtol=1e-5)


def test_zigzag_order_gives_each_device_an_early_and_a_late_chunk():
    assert zigzag_order(16, 4).reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="length=12 must be a multiple of 2 \\* n=8"):
        zigzag_order(12, 4)


def _single_device_logits(weights, ids):
    page_size = 4
    pages = -(-len(ids) // page_size)
    out = forward(weights, TINY, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids))[None], jnp.ones((1, len(ids)), bool),
                  jnp.arange(pages)[None], KVCache.zeros(TINY, pages, page_size, jnp.float32), attention="reference")
    return np.asarray(out.logits[0])


@needs_12
@pytest.mark.parametrize("tp,sp", [(3, 4), (9, 1)])
def test_sharded_forward_equals_single_device(tp, sp):
    """A 40-token prompt in chunks of 16 (the last one padded), then one decode step, on a mesh."""
    weights = random_weights(TINY, jax.random.key(1))
    ids = list(np.random.default_rng(0).integers(0, TINY.vocab_size, 41))
    expected = _single_device_logits(weights, ids)
    engine = EngineConfig(num_pages=16, page_size=4, max_pages_per_slot=12, chunk_buckets=(16,),
                          parallel=ParallelConfig(tp=tp, sp=sp))
    plan = MeshPlan.build(TINY, weights, engine)
    pool = PageAllocator(16, 4, shards=sp)
    table = np.array([[pool.allocate(i) for i in range(12)]], np.int32)
    cache = plan.zeros_cache(16, 4, jnp.float32)
    step = jax.jit(partial(forward, cfg=plan.model_cfg, attention=plan.attention), donate_argnames="cache")
    for start, width in [(0, 16), (16, 16), (32, 16), (40, 1)]:
        n = min(width, 41 - start)
        inp = StepInput.build([None], width, 12, 1)
        inp.tokens[0, :n], inp.positions[0, :n], inp.valid[0, :n] = ids[start:start + n], np.arange(start, start + n), True
        inp = plan.reorder(inp)
        out = step(plan.weights, tokens=inp.tokens, positions=inp.positions, valid=inp.valid, page_table=table,
                   cache=cache)
        cache = out.cache
        logits = np.asarray(out.logits[0])[np.argsort(zigzag_order(width, sp))] if width > 1 and sp > 1 else \
            np.asarray(out.logits[0])
        np.testing.assert_allclose(logits[:n], expected[start:start + n], atol=2e-5, rtol=1e-4,
                                   err_msg=f"positions {start}..{start + n}")
    assert cache.k[0].addressable_shards[0].data.shape == (plan.model_cfg.num_kv_heads // tp, 16 // sp, 4, 8)
