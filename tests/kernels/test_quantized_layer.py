"""The int8 decode-layer kernel against its reference, and the reference against the model's own layer math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_layer import LayerWeights, decode_layer_reference


def random_layer(rng: np.random.Generator, d: int, f: int, nq: int) -> LayerWeights:
    def values(*shape):
        return jnp.asarray(rng.integers(-127, 128, size=shape, dtype=np.int8))

    def scales(*shape, fan_in):  # products of unit size: int8 values of ~73 rms over fan_in inputs
        return jnp.asarray(rng.uniform(0.5, 1.5, size=shape).astype(np.float32) / (73 * np.sqrt(fan_in)))

    def gain():
        return jnp.asarray(rng.uniform(0.5, 1.5, size=(d,)), jnp.bfloat16)

    return LayerWeights(values(d, d), scales(d, fan_in=d), gain(), values(f, 2, d), scales(2, f, fan_in=d),
                        values(d, f), scales(d, fan_in=f), gain(), values(nq, d), scales(nq, fan_in=d))


def test_reference_is_the_models_layer_math():
    """The reference's layer (wo, residual, norm, gate_up, SiLU·up, down, residual, the next norm and qkv) is what
    jaxserve's transformer computes with the same int8 weights through its own products."""
    from jaxserve.model.quant import QuantizedArray, linear
    from jaxserve.model.transformer import normed_linear

    rng = np.random.default_rng(0)
    d, f, nq, m, eps = 256, 512, 384, 3, 1e-5
    w = random_layer(rng, d, f, nq)
    a = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    h0 = jnp.asarray(rng.standard_normal((m, d)) * 4, jnp.bfloat16)
    q = lambda v, s, in_ndim=1: QuantizedArray(v, s[None], in_ndim=in_ndim, backend="reference")  # noqa: E731
    wo, down, qkv = q(w.wo, w.wo_scales), q(w.down, w.down_scales), q(w.qkv, w.qkv_scales)
    gate_up = q(w.gate_up, w.gate_up_scales.T)
    h1 = h0 + linear(a, wo)
    gu = normed_linear(h1, w.mlp_norm, gate_up, eps)
    h2 = h1 + linear(jax.nn.silu(gu[..., 0]) * gu[..., 1], down)
    want_qkv = normed_linear(h2, w.attn_norm, qkv, eps)
    got_h2, got_qkv = decode_layer_reference(a, h0, w, eps=eps)
    np.testing.assert_allclose(np.asarray(got_h2, np.float32), np.asarray(h2, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got_qkv, np.float32), np.asarray(want_qkv, np.float32), rtol=3e-2,
                               atol=3e-2 * float(jnp.abs(want_qkv.astype(jnp.float32)).max()))


def test_layer_kernel_lowers_for_cuda_on_the_8b_layer():
    """Mosaic GPU lowers the whole 8B layer here on the CPU (layouts, shared memory, the phases' copies)."""
    from pallas_kernels.quantized_layer import mosaic_gpu

    d, f, nq = 4096, 14336, 6144
    s = jax.ShapeDtypeStruct
    w = LayerWeights(s((d, d), jnp.int8), s((d,), jnp.float32), s((d,), jnp.bfloat16), s((f, 2, d), jnp.int8),
                     s((2, f), jnp.float32), s((d, f), jnp.int8), s((d,), jnp.float32), s((d,), jnp.bfloat16),
                     s((nq, d), jnp.int8), s((nq,), jnp.float32))
    jax.jit(lambda a, h, w: mosaic_gpu._decode_layer(a, h, w, eps=1e-5)).trace(
        s((1, d), jnp.bfloat16), s((1, d), jnp.bfloat16), w).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("m,f,programs", [(1, 1024, None), (8, 1536, None), (2, 1024, 40)])
def test_layer_kernel_matches_reference(m, f, programs):
    """Both outputs against the reference, twice in a row (the grid-shared semaphores are back at zero after a call),
    with every SM and with fewer programs (more units a program, other tiles split)."""
    from pallas_kernels.quantized_layer import mosaic_gpu

    rng = np.random.default_rng(m)
    d, nq, eps = 4096, 1536, 1e-5
    w = random_layer(rng, d, f, nq)
    a = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    h0 = jnp.asarray(rng.standard_normal((m, d)) * 4, jnp.bfloat16)
    want_h2, want_qkv = decode_layer_reference(a, h0, w, eps=eps)
    run = jax.jit(lambda a, h0, w: mosaic_gpu.decode_layer(a, h0, w, eps=eps, programs=programs))
    for _ in range(2):
        h2, qkv = run(a, h0, w)
        np.testing.assert_allclose(np.asarray(h2, np.float32), np.asarray(want_h2, np.float32), rtol=2e-2, atol=5e-2)
        scale = float(jnp.abs(want_qkv.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(qkv, np.float32), np.asarray(want_qkv, np.float32), rtol=2e-2,
                                   atol=2e-2 * scale)


def test_layer_kernel_names_what_it_cannot_take():
    from pallas_kernels.quantized_layer import mosaic_gpu

    rng = np.random.default_rng(1)
    w = random_layer(rng, 4096, 256, 128)
    a = h0 = jnp.zeros((1, 4096), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"gate_up_scales has shape \(256, 2\)"):
        mosaic_gpu._decode_layer(a, h0, w._replace(gate_up_scales=w.gate_up_scales.T), eps=1e-5)
    with pytest.raises(ValueError, match="down must be int8 values"):
        mosaic_gpu._decode_layer(a, h0, w._replace(down=w.down.astype(jnp.int16)), eps=1e-5)
    with pytest.raises(ValueError, match="m <= 8 rows, d a multiple of 4096"):
        mosaic_gpu._decode_layer(jnp.zeros((9, 4096), jnp.bfloat16), jnp.zeros((9, 4096), jnp.bfloat16), w, eps=1e-5)
    with pytest.raises(ValueError, match=r"trial='no-barrier': unknown \['no-barrier'\]"):
        mosaic_gpu._decode_layer(a, h0, w, eps=1e-5, trial="no-barrier")
    with pytest.raises(ValueError, match="programs=17 must be 1-16: one an SM .* at most the 16 units"):
        mosaic_gpu._decode_layer(a, h0, w, eps=1e-5, programs=17)  # qkv: one tile of 16 steps
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="no interpreted form"):
            mosaic_gpu.decode_layer(a, h0, w, eps=1e-5)


@pytest.mark.parametrize("d,f,nq", [(4096, 512, 1536), (4096, 1024, 1536), (4096, 256, 128), (4096, 14336, 6144)])
def test_every_program_holds_a_unit_of_every_phase(d, f, nq):
    """With the default programs every run is non-empty, so every program between a tile's owner and its last
    holder holds a piece and signals it (the owner waits for last - owner signals): small layers take fewer
    programs than SMs (at f=512 the down phase has 64 units), the 8B layer all 132."""
    from pallas_kernels.quantized_layer import mosaic_gpu

    programs = mosaic_gpu.default_programs(d, f, nq)
    assert programs == min(mosaic_gpu.NUM_SMS, min(ph.units for ph in mosaic_gpu.plan(d, f, nq, mosaic_gpu.NUM_SMS)))
    for ph in mosaic_gpu.plan(d, f, nq, programs):
        runs = [(p * ph.units // programs, (p + 1) * ph.units // programs) for p in range(programs)]
        assert all(begin < end for begin, end in runs), ph.name
        for tile in range(ph.tiles):  # holders(): the programs holding the tile's first and last units
            first_unit, last_unit = tile * ph.steps, (tile + 1) * ph.steps - 1
            owner = next(p for p, (b, e) in enumerate(runs) if b <= first_unit < e)
            last = next(p for p, (b, e) in enumerate(runs) if b <= last_unit < e)
            assert owner == -(-(first_unit + 1) * programs // ph.units) - 1
            assert last == -(-(last_unit + 1) * programs // ph.units) - 1
