"""The fused int8 MLP kernel and its gate items alone (gate_up_silu): schedule, lowering on the CPU, numbers on the
GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_mlp import gate_up_silu, gate_up_silu_reference, mosaic_gpu, quantized_mlp, quantized_mlp_reference


def random_mlp(rng: np.random.Generator, m: int, d: int, f: int):
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    r = jnp.asarray(rng.uniform(0.5, 1.5, m), jnp.float32)
    gu = jnp.asarray(rng.integers(-127, 128, (f, 2, d)), jnp.int8)
    gs = jnp.asarray(rng.uniform(0.5, 2.0, (1, f, 2)) / 127 / np.sqrt(d), jnp.float32)
    dw = jnp.asarray(rng.integers(-127, 128, (d, f)), jnp.int8)
    ds = jnp.asarray(rng.uniform(0.5, 2.0, (1, d)) / 127, jnp.float32)
    return x, r, gu, gs, dw, ds


def act_truth(x, r, gu, gs) -> np.ndarray:
    f64 = np.float64
    g = np.asarray(x, f64) @ (np.asarray(gu, f64) * np.asarray(gs, f64)[0][:, :, None]).reshape(-1, x.shape[1]).T
    g = g.reshape(x.shape[0], -1, 2) * np.asarray(r, f64)[:, None, None]
    return g[..., 0] / (1 + np.exp(-g[..., 0])) * g[..., 1]


def truth(x, r, gu, gs, dw, ds) -> np.ndarray:
    return act_truth(x, r, gu, gs) @ (np.asarray(dw, np.float64) * np.asarray(ds, np.float64)[0][:, None]).T


@pytest.mark.parametrize("d,f", [(4096, 14336), (512, 1792), (256, 1024)])
def test_schedule_takes_every_item_once_gates_first(d, f):
    for splits in mosaic_gpu.SPLITS:
        if not mosaic_gpu._fits(d, f, splits):
            continue
        items, end = mosaic_gpu.schedule(d, f, splits, 132)
        gates, downs = f // 64, (d // 128) * splits
        assert sorted(i for row in items for i in row) == list(range(gates + downs))
        for row in items:  # a program's gate items come before its down items (no program waits on itself)
            kinds = [i >= gates for i in row]
            assert kinds == sorted(kinds)
        gate_cost = d // 256 + mosaic_gpu.ITEM_STEPS
        down_cost = f // splits // 256 + mosaic_gpu.ITEM_STEPS
        work = gates * gate_cost + downs * down_cost
        # no better than perfect balance; no worse than balance plus one item of each kind (a down item waits
        # at most for the gate items of its split, which end within one gate item of the gate phase)
        assert work / 132 <= end <= work / 132 + gate_cost + down_cost


def test_plan_pads_nothing_but_the_lists():
    splits, table = mosaic_gpu.plan(4096, 14336)
    assert table.shape[0] == 132 and splits in mosaic_gpu.SPLITS
    filler = mosaic_gpu.filler(4096, 14336, splits)
    assert filler == 14336 // 64 + 32 * splits  # one past the last item
    assert sorted(table[table != filler].tolist()) == list(range(filler))


def test_lowers_for_cuda_on_the_8b_shapes():
    d, f = 4096, 14336
    shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [((8, d), jnp.bfloat16), ((8,), jnp.float32),
              ((f, 2, d), jnp.int8), ((1, f, 2), jnp.float32), ((d, f), jnp.int8), ((1, d), jnp.float32)]]
    jax.jit(lambda *a: mosaic_gpu.quantized_mlp(*a, interpret=False)).trace(*shapes).lower(
        lowering_platforms=("cuda",))


def test_bad_inputs_name_the_values():
    rng = np.random.default_rng(0)
    x, r, gu, gs, dw, ds = random_mlp(rng, 2, 256, 1024)
    with pytest.raises(ValueError, match=r"per-channel scales: gate_up \[1, 1024, 2\]"):
        mosaic_gpu.quantized_mlp(x, r, gu, jnp.ones((2, 1024, 2)), dw, ds, interpret=False)
    with pytest.raises(ValueError, match="up to 16 rows"):
        mosaic_gpu.quantized_mlp(jnp.zeros((17, 256), jnp.bfloat16), jnp.ones(17), gu, gs, dw, ds, interpret=False)
    with pytest.raises(NotImplementedError, match="no interpreted form"):
        mosaic_gpu.quantized_mlp(x, r, gu, gs, dw, ds, interpret=True)
    with pytest.raises(ValueError, match=r"r must hold one number a row: shape \(2,\), got \(3,\)"):
        mosaic_gpu.quantized_mlp(x, jnp.ones(3), gu, gs, dw, ds, interpret=False)
    with pytest.raises(ValueError, match="stages=5 must be 2, 3 or 4"):
        mosaic_gpu.quantized_mlp(x, r, gu, gs, dw, ds, stages=5, interpret=False)
    with pytest.raises(ValueError, match="splits=3 must cut f=1024"):
        mosaic_gpu.plan(256, 1024, splits=3)
    with pytest.raises(ValueError, match="splits=0 has no down items: that is gate_up_silu"):
        mosaic_gpu.quantized_mlp(x, r, gu, gs, dw, ds, splits=0, interpret=False)
    with pytest.raises(ValueError, match="gate_up_silu takes up to 16 rows, d a multiple of 256 and f of 64; got "
                                         "m=2, d=256, f=1000"):
        mosaic_gpu.gate_up_silu(x, r, gu[:1000], gs[:, :1000], interpret=False)
    with pytest.raises(NotImplementedError, match="no interpreted form"):
        mosaic_gpu.gate_up_silu(x, r, gu, gs, interpret=True)
    with pytest.raises(ValueError, match="backend='xla' must be 'auto', 'reference' or 'mosaic_gpu'"):
        gate_up_silu(x, r, gu, gs, backend="xla")
    with pytest.raises(ValueError, match="backend='mosaic_tpu' must be 'auto', 'reference' or 'mosaic_gpu'"):
        quantized_mlp(x, r, gu, gs, dw, ds, backend="mosaic_tpu")


def test_gate_items_alone_take_each_once_and_lower_for_cuda():
    d, f = 4096, 14336
    splits, table = mosaic_gpu.plan(d, f, splits=0)
    filler = mosaic_gpu.filler(d, f, 0)
    assert splits == 0 and filler == f // 64
    assert sorted(table[table != filler].tolist()) == list(range(f // 64))
    shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [((8, d), jnp.bfloat16), ((8,), jnp.float32),
              ((f, 2, d), jnp.int8), ((1, f, 2), jnp.float32)]]
    jax.jit(lambda *a: mosaic_gpu.gate_up_silu(*a, interpret=False)).trace(*shapes).lower(lowering_platforms=("cuda",))


def test_gate_up_silu_reference_matches_float64_and_is_the_mlps_first_half():
    rng = np.random.default_rng(2)
    x, r, gu, gs, dw, ds = random_mlp(rng, 3, 256, 1024)
    want = act_truth(x, r, gu, gs)
    got = np.asarray(gate_up_silu_reference(x.astype(jnp.float32), r, gu, gs))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert gate_up_silu(x, r, gu, gs).dtype == jnp.bfloat16  # x's dtype; on the CPU the reference


def test_reference_matches_float64():
    rng = np.random.default_rng(1)
    args = random_mlp(rng, 3, 256, 1024)
    want = truth(*args)
    got = np.asarray(quantized_mlp_reference(*args))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("m,d,f,splits", [(1, 4096, 14336, None), (8, 4096, 14336, 4), (5, 512, 1792, None),
                                          (16, 256, 1024, 4), (3, 4096, 14336, 14)])
def test_kernel_matches_float64(m, d, f, splits):
    rng = np.random.default_rng(m * d + f)
    fn = jax.jit(lambda *a: quantized_mlp(*a, backend="mosaic_gpu", splits=splits))
    for _ in range(3):  # new rows each call: a semaphore not taken back to zero would let a call read stale act
        args = random_mlp(rng, m, d, f)
        want = truth(*args)
        got = np.asarray(fn(*args))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("m,d,f", [(1, 4096, 14336), (8, 4096, 14336), (5, 512, 1792), (16, 256, 1024)])
def test_gate_up_silu_kernel_matches_float64(m, d, f):
    rng = np.random.default_rng(m + d + f)
    fn = jax.jit(lambda *a: gate_up_silu(*a, backend="mosaic_gpu"))
    for _ in range(2):
        x, r, gu, gs, _, _ = random_mlp(rng, m, d, f)
        want = act_truth(x, r, gu, gs)
        got = fn(x, r, gu, gs)
        assert got.shape == (m, f) and got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())

