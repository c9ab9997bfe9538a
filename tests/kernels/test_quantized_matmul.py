"""One int8-weight matmul suite, run by every backend (interpret subclasses on CPU, the real kernel on the GPU)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.quantized_matmul import quantized_matmul

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def random_weight(rng: np.random.Generator, n: int, k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 values [n, k] over the whole range and positive float32 scales [k // group, n]."""
    values = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    scales = rng.uniform(0.5, 2.0, size=(k // group, n)).astype(np.float32) / 127
    return values, scales


def truth(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64: x times the dequantized weight."""
    n, k = values.shape
    groups = scales.shape[0]
    w = values.astype(np.float64).reshape(n, groups, k // groups) * scales.T.astype(np.float64)[:, :, None]
    return np.asarray(x, np.float64) @ w.reshape(n, k).T


class MatmulSuite:
    backend = "reference"
    interpret: bool | None = None
    # (dtype, m, n, k, group): decode rows 1 and 5, a full 64-row tile, per-channel (group = k) and per-group
    CASES = [(d, m, n, k, g) for d, (m, n, k, g) in itertools.product(
        DTYPES, [(1, 256, 512, 512), (5, 128, 1024, 128), (64, 384, 256, 256), (3, 64, 192, 64)])]

    def block_sizes(self, case):
        return None

    def test_matches_float64(self, case):
        dtype, m, n, k, group = case
        rng = np.random.default_rng(abs(hash(case)) % 2**32)
        values, scales = random_weight(rng, n, k, group)
        x = testing.random_normal(rng, (m, k), DTYPES[dtype])
        out = quantized_matmul(x, jnp.asarray(values), jnp.asarray(scales), backend=self.backend,
                               interpret=self.interpret, block_sizes=self.block_sizes(case))
        assert out.shape == (m, n) and out.dtype == x.dtype
        expected = truth(np.asarray(x.astype(jnp.float32)), values, scales)
        assert testing.relative_error(out, expected) < testing.tolerance(self.backend, dtype)

    def test_float32_output_of_bfloat16_rows(self):
        rng = np.random.default_rng(7)
        values, scales = random_weight(rng, 128, 256, 256)
        x = testing.random_normal(rng, (2, 256), jnp.bfloat16)
        out = quantized_matmul(x, jnp.asarray(values), jnp.asarray(scales), out_dtype=jnp.float32,
                               backend=self.backend, interpret=self.interpret)
        assert out.dtype == jnp.float32
        expected = truth(np.asarray(x.astype(jnp.float32)), values, scales)
        assert testing.relative_error(out, expected) < testing.tolerance(self.backend, "bfloat16")


class TestReference(MatmulSuite):
    def test_bad_shapes_name_the_values(self):
        x = jnp.zeros((2, 64))
        with pytest.raises(ValueError, match="x has k=64 inputs, values have k=128"):
            quantized_matmul(x, jnp.zeros((8, 128), jnp.int8), jnp.ones((1, 8)))
        with pytest.raises(ValueError, match="values must be int8, got float32"):
            quantized_matmul(x, jnp.zeros((8, 64)), jnp.ones((1, 8)))
        with pytest.raises(ValueError, match=r"scales.shape=\(3, 8\) must be \[groups, n=8\] with groups dividing k=64"):
            quantized_matmul(x, jnp.zeros((8, 64), jnp.int8), jnp.ones((3, 8)))


class InterpretSuite(MatmulSuite):
    interpret = True
    CASES = [("bfloat16", 1, 128, 256, 256), ("float32", 5, 128, 256, 128), ("bfloat16", 16, 192, 128, 64)]


class TestMosaicGPUInterpret(InterpretSuite):
    backend = "mosaic_gpu"

    def block_sizes(self, case):
        from pallas_kernels.quantized_matmul.mosaic_gpu import BlockSizes

        _, m, n, k, group = case
        # 2 k splits with stages=2, and a program of one compute warpgroup (block_n 64); the ring wraps in the
        # cases of test_steps_of_256_inputs_match_float64
        return BlockSizes(num_splits=2, stages=2) if n % 128 == 0 else BlockSizes(block_n=64, block_m=8)

    def test_default_splits_fill_the_chip(self):
        from pallas_kernels.quantized_matmul.mosaic_gpu import default_splits

        # 8B-shaped decode (batch 1, steps of 256 inputs): wq/wo 4096x4096 (32 tiles) and w_down (14336 -> 4096)
        # split 4 ways into one wave; gate/up (4096 -> 14336: 112 tiles) already fill one wave; the same with
        # steps of 128 inputs (wider activation tiles)
        for block_k in (256, 128):
            assert default_splits(1, 4096, 4096, 4096, 128, block_k, 8) == 4
            assert default_splits(1, 4096, 14336, 14336, 128, block_k, 8) == 4
            assert default_splits(1, 14336, 4096, 4096, 128, block_k, 8) == 1


# (m, n, k, group, num_splits): a 256-input step is two 128-byte swizzle tiles a row, converted together, then two
# products; one split or several, per-channel scales or groups of one step or of two (a split inside a group at a
# later scale row: 4 splits of 256 in groups of 512), through the ring more than once
WIDE_STEP_CASES = [(5, 128, 1024, 1024, 1), (3, 256, 1024, 256, 2), (8, 128, 512, 512, 2), (2, 128, 1024, 512, 1),
                   (8, 128, 1024, 512, 4)]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("wide_case", WIDE_STEP_CASES)
def test_steps_of_256_inputs_match_float64(wide_case, interpret):
    from pallas_kernels.quantized_matmul import mosaic_gpu

    m, n, k, group, splits = wide_case
    rng = np.random.default_rng(3)
    values, scales = random_weight(rng, n, k, group)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    bs = mosaic_gpu.BlockSizes(block_k=256, stages=2, num_splits=splits)
    out = quantized_matmul(x, jnp.asarray(values), jnp.asarray(scales), backend="mosaic_gpu", interpret=interpret,
                           block_sizes=bs, out_dtype=jnp.float32)
    want = truth(np.asarray(x.astype(jnp.float32)), values, scales)
    # unsplit output leaves the kernel in 16 bits (mosaic_dtype), split partials in float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_decode_rows_take_steps_of_256_inputs():
    """Up to WIDE_STEP_ROWS rows a step takes 256 inputs at 3 stages (measured faster on the H100 at 8 rows: every 8B
    decode product, the head from 93 to 99 % of a device copy); more rows, or k or scale groups that 256 does not
    divide, keep 128 (or 64) at 4 stages or fewer."""
    from pallas_kernels.quantized_matmul.mosaic_gpu import WIDE_STEP_ROWS, BlockSizes, _resolve

    def tiling(m, n, k, group, **fields):
        bs = _resolve(BlockSizes(**fields), m, n, k, group)
        return bs.block_k, bs.stages

    assert tiling(1, 28672, 4096, 4096) == (256, 3)
    assert tiling(WIDE_STEP_ROWS, 4096, 14336, 14336) == (256, 3)
    assert tiling(WIDE_STEP_ROWS + 1, 28672, 4096, 4096) == (128, 4)
    assert tiling(8, 28672, 4096, 128) == (128, 4)  # per-group scales of 128
    assert tiling(8, 4096, 4224, 4224) == (128, 4)  # k = 33 x 128
    assert tiling(8, 4096, 4096, 4096, stages=2) == (256, 2)
    assert tiling(8, 4096, 4096, 4096, num_splits=32) == (128, 4)  # a split of 128 inputs: no 256-input step
    assert tiling(8, 28672, 4096, 4096, block_m=24) == (128, 4)  # the rows of a program decide, not m
    assert tiling(64, 28672, 4096, 4096, block_m=16) == (256, 3)
    assert tiling(16, 28672, 4096, 4096, block_n=256, stages=4) == (128, 4)  # 4 x 72 KiB: not in shared memory


class TestMosaicTPUInterpret(InterpretSuite):
    backend = "mosaic_tpu"
    CASES = [("bfloat16", 1, 128, 256, 256), ("float32", 5, 256, 512, 128)]


@pytest.mark.gpu
class TestMosaicGPU(MatmulSuite):
    backend = "mosaic_gpu"
    interpret = False


@pytest.mark.parametrize("rows", [8, 104, 128])
def test_decode_tilings_fit_in_shared_memory_and_lower_for_cuda(rows):
    """Every 8B decode product up to MAX_KERNEL_ROWS rows gets a tiling that fits the H100's shared memory (fewer
    stages for wide activation tiles), checked by lowering the kernel for CUDA here on the CPU."""
    import jax

    from pallas_kernels.quantized_matmul import MAX_KERNEL_ROWS, mosaic_gpu

    assert rows <= MAX_KERNEL_ROWS
    for n, k, group in [(6144, 4096, 4096), (4096, 4096, 4096), (28672, 4096, 4096), (4096, 14336, 14336),
                        (28672, 4096, 128)]:
        assert mosaic_gpu.supports(rows, n, k, group, jnp.bfloat16)
        shapes = [jax.ShapeDtypeStruct(s, d) for s, d in
                  [((rows, k), jnp.bfloat16), ((n, k), jnp.int8), ((k // group, n), jnp.float32)]]
        jax.jit(lambda x, v, s: mosaic_gpu.quantized_matmul(x, v, s, interpret=False)).trace(
            *shapes).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="bytes of shared memory"):
        mosaic_gpu.quantized_matmul(jnp.zeros((128, 14336), jnp.bfloat16), jnp.zeros((4096, 14336), jnp.int8),
                                    jnp.ones((1, 4096), jnp.float32), block_sizes=mosaic_gpu.BlockSizes(stages=4))


# (m, n, k, block_n, programs): stream-K runs that split tiles among 2 and 3 programs (the last piece zeroing the
# slot nobody else writes), programs across two and three tiles, runs of 10-11 units through a ring of 3 (its
# slots reused, the drain longer than the ring), one compute warpgroup, more programs than units
STREAM_K_CASES = [(5, 384, 1024, 128, 5), (3, 384, 1024, 128, 7), (8, 512, 256, 128, 2), (2, 768, 256, 128, 2),
                  (4, 256, 4096, 128, 3), (1, 192, 512, 64, 4), (2, 128, 512, 128, 132)]


def test_stream_k_plan_counts_pieces_and_tiles():
    from pallas_kernels.quantized_matmul.mosaic_gpu import stream_k_plan

    assert stream_k_plan(4, 3, 5) == (2, 2)  # programs of 2-3 units over tiles of 4
    assert stream_k_plan(4, 3, 7) == (3, 2)
    assert stream_k_plan(1, 4, 2) == (1, 2)
    assert stream_k_plan(16, 224, 132) == (2, 3)  # 8B gate_up at batch 1: 27-28 units a program
    assert stream_k_plan(56, 32, 132) == (5, 2)  # 8B down


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sk_case", STREAM_K_CASES)
def test_stream_k_matches_float64(sk_case, interpret):
    from pallas_kernels.quantized_matmul import mosaic_gpu

    m, n, k, block_n, programs = sk_case
    rng = np.random.default_rng(m * n + programs)
    values, scales = random_weight(rng, n, k, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    bs = mosaic_gpu.BlockSizes(block_n=block_n, stream_k=True, programs=programs)
    out = quantized_matmul(x, jnp.asarray(values), jnp.asarray(scales), backend="mosaic_gpu", interpret=interpret,
                           block_sizes=bs, out_dtype=jnp.float32)
    want = truth(np.asarray(x.astype(jnp.float32)), values, scales)
    # bfloat16 rows (exact in float16 after the shift, but for the rare |x| < 2^-13) times int8 values are exact
    # products; only the float32 sums round
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# (m, n, k, stream_k): the split grid with one and with several k splits, and stream-K
FLOAT16_CASES = [(8, 256, 512, None), (3, 384, 4096, None), (5, 384, 1024, True)]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("float16", [True, False])
@pytest.mark.parametrize("f16_case", FLOAT16_CASES)
def test_float16_and_bfloat16_products_match_float64(f16_case, float16, interpret):
    """BlockSizes(float16=True) (the default): activations enter as x · X_SHIFT in float16, the weights convert by
    prmt/xor/sub on the GPU, and the scales take the shift back: activations beyond float16's range unshifted and
    small ones come out as exact as in bfloat16 (float16=False), against float64."""
    from pallas_kernels.quantized_matmul import mosaic_gpu

    m, n, k, stream_k = f16_case
    rng = np.random.default_rng(m * n)
    values, scales = random_weight(rng, n, k, k)
    x = rng.standard_normal((m, k))
    x[0, :4] = [3e5, -1e5, 2e-4, -3e-3]  # beyond float16's range unshifted (65504); small values
    x = jnp.asarray(x, jnp.bfloat16)
    bs = mosaic_gpu.BlockSizes(float16=float16, stream_k=stream_k, num_splits=None if stream_k else 1 if m == 8 else 4)
    out = quantized_matmul(x, jnp.asarray(values), jnp.asarray(scales), backend="mosaic_gpu", interpret=interpret,
                           block_sizes=bs, out_dtype=jnp.float32)
    want = truth(np.asarray(x.astype(jnp.float32)), values, scales)
    # one split stores its output in bfloat16 (the kernel's output type); split and stream-K sums are float32
    tol = 8e-3 if m == 8 else 1e-4
    np.testing.assert_allclose(np.asarray(out), want, rtol=tol, atol=tol * np.abs(want).max())


def test_stream_k_refuses_grouped_scales_and_row_tiles():
    from pallas_kernels.quantized_matmul import mosaic_gpu

    with pytest.raises(ValueError, match="group=128 must be k=256"):
        mosaic_gpu._resolve(mosaic_gpu.BlockSizes(stream_k=True), 8, 128, 256, 128)
    with pytest.raises(ValueError, match="m=24 must be at most block_m=8"):
        mosaic_gpu._resolve(mosaic_gpu.BlockSizes(stream_k=True, block_m=8), 24, 128, 256, 256)
    with pytest.raises(ValueError, match="num_splits=2 must be left unset"):
        mosaic_gpu._resolve(mosaic_gpu.BlockSizes(stream_k=True, num_splits=2), 8, 128, 256, 256)


def test_stream_k_lowers_for_cuda_on_the_8b_decode_shapes():
    import jax

    from pallas_kernels.quantized_matmul import mosaic_gpu

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [((8, k), jnp.bfloat16), ((n, k), jnp.int8),
                                                          ((1, n), jnp.float32)]]
        jax.jit(lambda x, v, s: mosaic_gpu.quantized_matmul(
            x, v, s, interpret=False, block_sizes=mosaic_gpu.BlockSizes(stream_k=True))).trace(
            *shapes).lower(lowering_platforms=("cuda",))


def test_stream_k_is_the_default_only_where_a_device_kind_gains(monkeypatch):
    """With a threshold (the H200's), decode's qkv (96 of 132 SMs busy) and gate_up (224 programs over 264 slots)
    take stream-K, the products that fill their waves do not; without one (the H100, the CPU) none does."""
    from pallas_kernels.quantized_matmul import mosaic_gpu

    shapes = {"qkv": (6144, 4096), "wo": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "head": (128256, 4096)}

    def chosen():
        return {name for name, (n, k) in shapes.items()
                if mosaic_gpu._resolve(mosaic_gpu.BlockSizes(), 8, n, k, k).stream_k}

    monkeypatch.setattr(mosaic_gpu, "stream_k_idle", lambda: None)
    assert chosen() == set()
    monkeypatch.setattr(mosaic_gpu, "stream_k_idle", lambda: 0.1)
    assert chosen() == {"qkv", "gate_up"}
    assert not mosaic_gpu._resolve(mosaic_gpu.BlockSizes(), 64, 6144, 4096, 4096).stream_k  # wide tiles: no
    assert not mosaic_gpu._resolve(mosaic_gpu.BlockSizes(num_splits=2), 8, 6144, 4096, 4096).stream_k
