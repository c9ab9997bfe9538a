"""One flash-attention suite, run by every backend: reference, Mosaic GPU and Mosaic TPU interpreted on
CPU, and Mosaic GPU compiled on a Hopper GPU (marked gpu)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.flash_attention import flash_attention, paged_flash_attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FULL = [(d, hd, g, c) for d, hd, g, c in itertools.product(DTYPES, (64, 128), (1, 4, 8), (True, False))]
PAGE_SIZE = 16


class FlashSuite:
    backend = "reference"
    interpret: bool | None = None
    kv_heads = 2
    batch = 2
    CASES = FULL
    NAN_CASES = FULL
    FLOAT8 = True  # the backend reads float8_e4m3fn pages

    def block_sizes(self, case):
        return None

    def q_len(self, group: int) -> int:
        return 128

    def test_dense(self, case):
        dtype, hd, group, causal = case
        rng = np.random.default_rng(hash(case) % 2**32)
        t, s = self.q_len(group), 256
        q = testing.random_normal(rng, (self.batch, t, group * self.kv_heads, hd), DTYPES[dtype])
        k = testing.random_normal(rng, (self.batch, s, self.kv_heads, hd), DTYPES[dtype])
        v = testing.random_normal(rng, (self.batch, s, self.kv_heads, hd), DTYPES[dtype])
        out = flash_attention(q, k, v, causal=causal, backend=self.backend, interpret=self.interpret,
                              block_sizes=self.block_sizes(case))
        q_start = np.full(self.batch, s - t if causal else 0)
        truth = testing.attention_truth(q, k, v, q_start, np.full(self.batch, s), causal=causal)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend_name, dtype)

    def test_paged_chunk(self, case):
        """Rows of lengths 1, page_size + 1 and full; the full row's chunk follows 32 earlier tokens in pages."""
        self.check_paged_chunk(case, stale_nan=False)

    def test_stale_nan_in_pages_does_not_leak(self, nan_case):
        """NaN in the slots past each row's length, in unused pages and behind unused table entries."""
        self.check_paged_chunk(nan_case, stale_nan=True)

    @pytest.mark.parametrize("causal", [True, False])
    def test_float8_pages(self, causal):
        """A chunk over float8_e4m3fn pages, stale NaN past the lengths, against the truth on the same values."""
        case = ("bfloat16", 128, 4, causal)
        if self.FLOAT8:
            self.check_paged_chunk(case, stale_nan=True, kv_dtype=jnp.float8_e4m3fn)
            return
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            self.check_paged_chunk(case, stale_nan=False, kv_dtype=jnp.float8_e4m3fn)

    @pytest.mark.parametrize("options", [{"window": 200}, {"softcap": 0.6}, {"window": 17, "softcap": 1.0}],
                             ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
    def test_window_and_softcap(self, options):
        """A chunk after a prefix of 300 tokens, in K/V blocks of 64 where the kernel takes the size: the blocks
        wholly behind the window skipped, those its edge crosses masked (with 200, whole blocks between them, with 17
        every block the chunk sees); soft-capped scores."""
        case = ("bfloat16", 64, 2, True)
        self.check_paged_chunk(case, stale_nan=True, prefix=300, block_sizes=self.small_blocks(case), **options)

    def small_blocks(self, case):
        return self.block_sizes(case)

    def test_wide_heads_in_the_default_tiling(self):
        """head_dim 256 (Gemma 2 and 3) in the tiling a model gets: compiled, it must fit in shared memory."""
        case = ("bfloat16", 256, 2, True)
        rng = np.random.default_rng(11)
        t, s = self.q_len(2), 256
        q = testing.random_normal(rng, (1, t, 2 * self.kv_heads, 256), jnp.bfloat16)
        k, v = (testing.random_normal(rng, (1, s, self.kv_heads, 256), jnp.bfloat16) for _ in range(2))
        out = flash_attention(q, k, v, causal=True, backend=self.backend, interpret=self.interpret)
        truth = testing.attention_truth(q, k, v, np.full(1, s - t), np.full(1, s), causal=True)
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend_name, "bfloat16")
        self.check_paged_chunk(case, stale_nan=True, default_tiling=True)

    def check_paged_chunk(self, case, *, stale_nan: bool, kv_dtype=None, prefix: int = 32, softcap=None, window=None,
                          block_sizes=None, default_tiling: bool = False):
        dtype, hd, group, causal = case
        rng = np.random.default_rng(hash(case) % 2**32 + 1)
        t = self.q_len(group)
        pages_per_row = -(-(t + prefix) // PAGE_SIZE)
        full = pages_per_row * PAGE_SIZE
        lengths = np.array([1, PAGE_SIZE + 1, full], np.int32)
        q_start = np.array([0, 0, full - t], np.int32)
        num_pages = 3 * pages_per_row + 5
        q = testing.random_normal(rng, (3, t, group * self.kv_heads, hd), DTYPES[dtype])
        kp = testing.random_normal(rng, (self.kv_heads, num_pages, PAGE_SIZE, hd), DTYPES[dtype])
        vp = testing.random_normal(rng, (self.kv_heads, num_pages, PAGE_SIZE, hd), DTYPES[dtype])
        table = testing.random_page_table(rng, 3, pages_per_row, num_pages)
        if stale_nan:  # with a window, also the keys behind every query's window (pages released early)
            behind = None if window is None else q_start - window + 1
            kp, table = testing.poison_unused(rng, kp.astype(jnp.float32), table, lengths, behind)
            vp, _ = testing.poison_unused(rng, vp.astype(jnp.float32), table, lengths, behind)
            kp, vp = jnp.asarray(kp, DTYPES[dtype]), jnp.asarray(vp, DTYPES[dtype])
        if kv_dtype is not None:
            kp, vp = jnp.asarray(kp, jnp.float32).astype(kv_dtype), jnp.asarray(vp, jnp.float32).astype(kv_dtype)
        out = paged_flash_attention(q, kp, vp, jnp.asarray(table), jnp.asarray(q_start), jnp.asarray(lengths),
                                    causal=causal, backend=self.backend, interpret=self.interpret,
                                    block_sizes=None if default_tiling else block_sizes or self.block_sizes(case),
                                    softcap=softcap, window=window)
        k = testing.dense_from_pages(np.nan_to_num(np.asarray(kp.astype(jnp.float32))), table)
        v = testing.dense_from_pages(np.nan_to_num(np.asarray(vp.astype(jnp.float32))), table)
        truth = testing.attention_truth(q.astype(jnp.float32), k, v, q_start, lengths, causal=causal, softcap=softcap,
                                        window=window)
        assert out.shape == q.shape
        assert np.all(np.isfinite(np.asarray(out, np.float32))), "stale page contents reached the output"
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend_name, dtype)

    @pytest.mark.parametrize("sm_scale", [0.3, -0.2, 0.0])
    def test_any_sm_scale(self, sm_scale):
        """The scale is used, and masked keys stay masked whatever its sign (a negative one reverses the max)."""
        case = ("float32", 64, 1, True)
        rng = np.random.default_rng(7)
        t, s = self.q_len(1), 256
        q = testing.random_normal(rng, (1, t, self.kv_heads, 64), jnp.float32)
        k, v = (testing.random_normal(rng, (1, s, self.kv_heads, 64), jnp.float32) for _ in range(2))
        out = flash_attention(q, k, v, causal=True, sm_scale=sm_scale, backend=self.backend, interpret=self.interpret,
                              block_sizes=self.block_sizes(case))
        truth = testing.attention_truth(q, k, v, np.full(1, s - t), np.full(1, s), causal=True, sm_scale=sm_scale)
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend_name, "float32")

    @property
    def backend_name(self) -> str:
        return self.backend


class TestReference(FlashSuite):
    # The masking does not depend on the shapes: a covering handful.
    NAN_CASES = [("float32", 64, 1, True), ("bfloat16", 128, 4, False), ("bfloat16", 64, 8, True)]

    def test_shape_errors_name_the_values(self):
        q = jnp.zeros((1, 8, 6, 64))
        k = jnp.zeros((1, 8, 4, 64))
        with pytest.raises(ValueError, match="heads=6 must be a multiple of kv_heads=4"):
            flash_attention(q, k, k)
        with pytest.raises(ValueError, match="q_len=16"):
            flash_attention(jnp.zeros((1, 16, 4, 64)), k, k, causal=True)



class InterpretSuite(FlashSuite):
    """Interpret mode is slow: one program per row, a covering handful of cases."""

    interpret = True
    kv_heads = 1
    batch = 1
    CASES = [("bfloat16", 64, 1, True), ("float32", 128, 4, False), ("bfloat16", 128, 8, True)]
    NAN_CASES = [("bfloat16", 64, 4, True)]

    def q_len(self, group: int) -> int:
        return 128 // group


class MosaicGPUOrder:
    """The program order of the Mosaic GPU kernel, interpreted and compiled."""

    def test_interleaved_units_find_their_rows_and_heads(self):
        """Causal programs of 4 (row, KV head, head group) units interleaved over 2 query tiles each: every program
        reads its own q, K/V and output."""
        from pallas_kernels.flash_attention.mosaic_gpu import BlockSizes, default_interleave

        # The benchmark's causal shapes (16 heads, 16k tokens) as simulated: 16k gains nothing from interleaving
        assert [default_interleave(True, 0, 16 * 16384 // t, t // 128, BlockSizes())
                for t in (2048, 4096, 8192, 16384)] == [4, 4, 2, 1]
        assert default_interleave(False, 0, 64, 32, BlockSizes()) == 1  # equal tiles
        assert default_interleave(True, None, 64, 32, BlockSizes()) == 1  # a paged chunk: its start is unknown
        rng = np.random.default_rng(5)
        q = testing.random_normal(rng, (2, 128, 8, 64), jnp.float32)  # 2 rows x 2 KV heads x 2 groups of 2 heads
        k, v = (testing.random_normal(rng, (2, 192, 2, 64), jnp.float32) for _ in range(2))
        run = functools.partial(flash_attention, q, k, v, causal=True, backend=self.backend, interpret=self.interpret)
        out = run(block_sizes=BlockSizes(heads_per_program=2, block_k=64, interleave=4))  # 2 tiles of 64 queries
        truth = testing.attention_truth(q, k, v, np.full(2, 64), np.full(2, 192), causal=True)
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend_name, "float32")
        for bad in (3, 0, -1):
            with pytest.raises(ValueError, match=rf"interleave={bad} must be at least 1 and divide .* 2 x 2 x 2 = 8"):
                run(block_sizes=BlockSizes(heads_per_program=2, block_k=64, interleave=bad))


class TestMosaicGPUInterpret(MosaicGPUOrder, InterpretSuite):
    backend = "mosaic_gpu"

    def block_sizes(self, case):
        from pallas_kernels.flash_attention.mosaic_gpu import BlockSizes

        return BlockSizes(heads_per_program=case[2])

    def small_blocks(self, case):
        from pallas_kernels.flash_attention.mosaic_gpu import BlockSizes

        return BlockSizes(heads_per_program=case[2], block_k=64)


class TestMosaicTPUInterpret(InterpretSuite):
    backend = "mosaic_tpu"
    FLOAT8 = False

    def block_sizes(self, case):
        """Several K/V blocks per row, so the double buffering runs; float32 takes half pages."""
        from pallas_kernels.flash_attention.mosaic_tpu import BlockSizes

        dtype, _, group, _ = case
        return BlockSizes(block_q=self.q_len(group), block_k=8 if dtype == "float32" else 32)

    def test_shape_errors_name_the_values(self):
        from pallas_kernels.flash_attention.mosaic_tpu import BlockSizes

        q = jnp.zeros((1, 24, 2, 64), jnp.bfloat16)
        k = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
        with pytest.raises(ValueError, match="q_len=24 must be a multiple of block_q=16"):
            flash_attention(q, k, k, backend="mosaic_tpu", block_sizes=BlockSizes(block_q=16))
        with pytest.raises(ValueError, match="kv_len=64 must be a multiple of block_k=48"):
            flash_attention(q, k, k, backend="mosaic_tpu", block_sizes=BlockSizes(block_k=48))
        pages = jnp.zeros((1, 8, 8, 64), jnp.bfloat16)
        rows = jnp.zeros((1,), jnp.int32)
        with pytest.raises(ValueError, match="page_size=8 and block_k=64 must be multiples of 16"):
            paged_flash_attention(q, pages, pages, jnp.zeros((1, 8), jnp.int32), rows, rows, backend="mosaic_tpu")

    def test_lowers_for_tpu(self):
        """The Pallas-to-Mosaic lowering (block shapes, primitives) runs here without a TPU."""
        q = jnp.zeros((2, 256, 8, 128), jnp.bfloat16)
        k = jnp.zeros((2, 512, 2, 128), jnp.bfloat16)
        pages = jnp.zeros((2, 64, 16, 128), jnp.bfloat16)
        rows = jnp.zeros((2,), jnp.int32)
        table = jnp.zeros((2, 32), jnp.int32)
        for causal in (True, False):
            options = dict(causal=causal, backend="mosaic_tpu", interpret=False)
            dense = jax.jit(functools.partial(flash_attention, **options)).trace(q, k, k)
            assert "tpu_custom_call" in dense.lower(lowering_platforms=("tpu",)).as_text()
            paged = jax.jit(functools.partial(paged_flash_attention, **options)).trace(q, pages, pages, table, rows, rows)
            assert "tpu_custom_call" in paged.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.gpu
class TestMosaicGPU(MosaicGPUOrder, FlashSuite):
    backend = "mosaic_gpu"
    interpret = False

    def small_blocks(self, case):
        from pallas_kernels.flash_attention.mosaic_gpu import BlockSizes

        return BlockSizes(block_k=64)
