"""One paged decode-attention suite, run by every backend (see test_flash_attention)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.paged_attention import paged_attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PAGE_SIZE = 16
SUITE_TILING = object()  # check_ragged_slots: the suite's block_sizes(case); None is the kernel's own default


class DecodeSuite:
    backend = "reference"
    interpret: bool | None = None
    kv_heads = 2
    pages_per_row = 24
    CASES = [(d, hd, g, s) for d, hd, g, s in itertools.product(DTYPES, (64, 128), (1, 2, 4, 8), (1, 3))]
    NAN_CASES = CASES
    FLOAT8 = True  # the backend reads float8_e4m3fn pages

    def block_sizes(self, case):
        return None

    def float8_block_sizes(self, case):
        """The tilings float8 pages run under: the backend's options for 8-bit pages beside the usual."""
        return [self.block_sizes(case)]

    def test_ragged_slots(self, case):
        """Slots of lengths 1, page_size + 1, full and 0 over random pages; s splits of the sequence."""
        self.check_ragged_slots(case, stale_nan=False)

    def test_stale_nan_in_pages_does_not_leak(self, nan_case):
        """NaN in the slots past each slot's length, in unused pages and behind unused table entries."""
        self.check_ragged_slots(nan_case, stale_nan=True)

    @pytest.mark.parametrize("splits", [1, 2])
    def test_float8_pages(self, splits):
        """float8_e4m3fn pages, stale NaN past the lengths, against the truth on the same float8 values."""
        case = ("bfloat16", 128, 4, splits)
        if self.FLOAT8:
            for bs in self.float8_block_sizes(case):
                self.check_ragged_slots(case, stale_nan=True, kv_dtype=jnp.float8_e4m3fn, block_sizes=bs)
            return
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            self.check_ragged_slots(case, stale_nan=False, kv_dtype=jnp.float8_e4m3fn)

    @pytest.mark.parametrize("splits,options", [(1, {"window": 40}), (2, {"window": 10}),
                                                (2, {"window": 100, "softcap": 1.0})],
                             ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()) if isinstance(o, dict) else str(o))
    def test_window_and_softcap(self, splits, options):
        """Ragged slots over several K/V blocks: blocks behind the window skipped (window 10 leaves the first split
        of the full slot nothing), the block its edge crosses masked, pages behind it NaN; soft-capped scores."""
        case = ("bfloat16", 64, 2, splits)
        self.check_ragged_slots(case, stale_nan=True, block_sizes=self.small_blocks(case), **options)

    def small_blocks(self, case):
        return self.block_sizes(case)

    def check_ragged_slots(self, case, *, stale_nan: bool, kv_dtype=None, block_sizes=SUITE_TILING, softcap=None,
                           window=None):
        dtype, hd, group, splits = case
        rng = np.random.default_rng(hash(case) % 2**32)
        full = self.pages_per_row * PAGE_SIZE
        lengths = np.array([1, PAGE_SIZE + 1, full, 0], np.int32)
        b = len(lengths)
        num_pages = b * self.pages_per_row + 3
        q = testing.random_normal(rng, (b, group * self.kv_heads, hd), DTYPES[dtype])
        kp = testing.random_normal(rng, (self.kv_heads, num_pages, PAGE_SIZE, hd), DTYPES[dtype])
        vp = testing.random_normal(rng, (self.kv_heads, num_pages, PAGE_SIZE, hd), DTYPES[dtype])
        table = testing.random_page_table(rng, b, self.pages_per_row, num_pages)
        if stale_nan:  # with a window, also the keys behind it (pages released early)
            behind = None if window is None else lengths - window
            kp, table = testing.poison_unused(rng, kp.astype(jnp.float32), table, lengths, behind)
            vp, _ = testing.poison_unused(rng, vp.astype(jnp.float32), table, lengths, behind)
            kp, vp = jnp.asarray(kp, DTYPES[dtype]), jnp.asarray(vp, DTYPES[dtype])
        if kv_dtype is not None:
            kp, vp = jnp.asarray(kp, jnp.float32).astype(kv_dtype), jnp.asarray(vp, jnp.float32).astype(kv_dtype)
        out = paged_attention(q, kp, vp, jnp.asarray(table), jnp.asarray(lengths), backend=self.backend,
                              interpret=self.interpret, softcap=softcap, window=window,
                              block_sizes=self.block_sizes(case) if block_sizes is SUITE_TILING else block_sizes)
        k = testing.dense_from_pages(np.nan_to_num(np.asarray(kp.astype(jnp.float32))), table)
        v = testing.dense_from_pages(np.nan_to_num(np.asarray(vp.astype(jnp.float32))), table)
        truth = testing.attention_truth(q.astype(jnp.float32)[:, None], k, v, lengths - 1, lengths, causal=False,
                                        softcap=softcap, window=window)[:, 0]
        assert out.shape == q.shape and out.dtype == q.dtype
        assert np.all(np.isfinite(np.asarray(out, np.float32))), "stale page contents reached the output"
        assert np.all(np.asarray(out[3], np.float32) == 0.0), "an empty slot returns zeros"
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend, dtype)


class TestReference(DecodeSuite):
    # It takes no tiling, so a case's split count would only change its random data: one split.
    CASES = [case for case in DecodeSuite.CASES if case[3] == 1]
    # The masking does not depend on the shapes: a covering handful.
    NAN_CASES = [("float32", 64, 1, 1), ("bfloat16", 128, 4, 3), ("bfloat16", 64, 8, 3)]

    def test_shape_errors_name_the_values(self):
        pages = jnp.zeros((2, 4, 16, 64))  # 2 KV heads, 4 pages
        with pytest.raises(ValueError, match="heads=3 must be a multiple of kv_heads=2"):
            paged_attention(jnp.zeros((1, 3, 64)), pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32))
        with pytest.raises(ValueError, match=r"lengths.shape=\(2,\) must be \(1,\)"):
            paged_attention(jnp.zeros((1, 2, 64)), pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones(2, jnp.int32))


class InterpretSuite(DecodeSuite):
    interpret = True
    kv_heads = 1
    pages_per_row = 9
    # group 2 over 4 slots: programs start at rows 0, 2, 4, 6 of an 8-row load (a neighbour's queries ride along)
    CASES = [("bfloat16", 64, 1, 1), ("float32", 128, 4, 2), ("bfloat16", 128, 8, 1), ("bfloat16", 64, 2, 2)]
    NAN_CASES = [("bfloat16", 64, 4, 2)]


class MosaicGPUOptions:
    """The Mosaic GPU kernel's tiling options, run by its interpreted and its GPU suites alike."""

    def small_blocks(self, case):
        """64-token blocks, two slots a program when unsplit (the ring crossing from a slot's window into the next)."""
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        splits = case[3]
        return BlockSizes(block_k=64, stages=2, num_splits=splits, slots_per_program=2 if splits == 1 else 1)

    def float8_block_sizes(self, case):
        """Also the kernel's own default for 8-bit pages, a third warpgroup converting the 8-bit tiles one
        block ahead over 64- and 128-token blocks, and that with transposed scores."""
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        splits = case[3]
        return [*super().float8_block_sizes(case), None,
                BlockSizes(block_k=64, stages=3, num_splits=splits, slots_per_program=2 if splits == 1 else 1,
                           convert_warpgroup=True),
                BlockSizes(block_k=64 if splits > 1 else 128, stages=2, num_splits=splits, slots_per_program=1,
                           convert_warpgroup=True),
                BlockSizes(block_k=64, stages=3, num_splits=splits, slots_per_program=2 if splits == 1 else 1,
                           convert_warpgroup=True, transposed=True),
                BlockSizes(block_k=128, stages=2, num_splits=splits, slots_per_program=1, transposed=True)]

    @pytest.mark.parametrize("shape", [("bfloat16", 128, 4, 1, 64), ("float32", 64, 2, 3, 64), ("bfloat16", 64, 8, 1, 128),
                                       ("bfloat16", 128, 1, 3, 128)], ids=lambda c: "-".join(map(str, c)))
    def test_transposed_scores(self, shape):
        """Scores as K·qᵀ (the group as the wgmma N): ragged slots, stale NaN past the lengths, split and not,
        64- and 128-token blocks."""
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        *case, block_k = shape
        splits = case[3]
        bs = BlockSizes(block_k=block_k, stages=2, num_splits=splits, slots_per_program=2 if splits == 1 else 1,
                        transposed=True)
        self.check_ragged_slots(tuple(case), stale_nan=True, block_sizes=bs)

    @pytest.mark.parametrize("group", [12, 16, 11])
    def test_transposed_query_rows(self, group):
        """Transposed programs hold 16 query rows: groups of 12 and 16 load 16; one of 11 (which may start 5 rows
        into an 8-row tile) would load 24 and is refused by name."""
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        bs = BlockSizes(block_k=64, stages=2, num_splits=1, transposed=True)
        if group == 11:
            with pytest.raises(ValueError, match="group heads//kv_heads=11 loads 24"):
                self.check_ragged_slots(("bfloat16", 64, group, 1), stale_nan=False, block_sizes=bs)
            return
        self.check_ragged_slots(("bfloat16", 64, group, 1), stale_nan=False, block_sizes=bs)


class TestMosaicGPUInterpret(MosaicGPUOptions, InterpretSuite):
    backend = "mosaic_gpu"

    def block_sizes(self, case):
        """Unsplit cases run two slots per program."""
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        return BlockSizes(num_splits=case[3], slots_per_program=2 if case[3] == 1 else 1)

    @pytest.mark.parametrize("transposed", [False, True])
    @pytest.mark.parametrize("heads,kv,slots,splits", [(4, 1, 2, 1), (9, 3, 1, 1), (6, 1, 1, 2)])
    def test_odd_shapes(self, heads, kv, slots, splits, transposed):
        """Three slots over 64-token blocks, stale NaN past each length.
        (4, 1, 2 slots): the K/V ring crosses from one slot into the next mid-ring, and the second program's
        second slot lies past the batch and writes nothing. (9, 3): groups of 3 load 16 rows and the last
        load is clamped to the (padded) end of q. (6, 1, split): a group of 6 at offsets 0, 6 and 4."""
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        rng = np.random.default_rng(heads)
        lengths = np.array([PAGE_SIZE + 1, 9 * PAGE_SIZE + 6, 5 * PAGE_SIZE], np.int32)
        q = testing.random_normal(rng, (3, heads, 64), jnp.bfloat16)
        kp = testing.random_normal(rng, (kv, 32, PAGE_SIZE, 64), jnp.float32)
        vp = testing.random_normal(rng, (kv, 32, PAGE_SIZE, 64), jnp.float32)
        table = testing.random_page_table(rng, 3, 10, 32)
        kp, table = testing.poison_unused(rng, np.asarray(kp), table, lengths)
        vp, _ = testing.poison_unused(rng, np.asarray(vp), table, lengths)
        kp, vp, table = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16), jnp.asarray(table)
        bs = BlockSizes(block_k=64, stages=2, slots_per_program=slots, num_splits=splits, transposed=transposed)
        out = paged_attention(q, kp, vp, table, jnp.asarray(lengths), backend=self.backend, interpret=True,
                              block_sizes=bs)
        k = testing.dense_from_pages(np.nan_to_num(np.asarray(kp.astype(jnp.float32))), np.asarray(table))
        v = testing.dense_from_pages(np.nan_to_num(np.asarray(vp.astype(jnp.float32))), np.asarray(table))
        truth = testing.attention_truth(q.astype(jnp.float32)[:, None], k, v, lengths - 1, lengths, causal=False)[:, 0]
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend, "bfloat16")

    def test_split_layout(self):
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes, split_layout

        def layout(batch, max_len):
            return split_layout(batch, 8, max_len, BlockSizes(block_k=128))

        assert layout(1, 1504) == (6, 256)  # 11 splits asked, each rounded up to two blocks: 48 programs
        assert layout(1, 8192) == (16, 512)  # 128 programs: one wave
        assert layout(8, 8192) == (3, 2816)  # 192 programs, not 320
        assert layout(1, 100) == (1, 128)  # shorter than a block
        assert layout(32, 8192) == (1, 8192)  # 256 (slot, head) pairs fill the chip unsplit
        for batch in (1, 2, 4, 8, 16):
            for max_len in (100, 512, 1000, 1504, 2048, 5000, 8192, 32768):
                splits, split_len = layout(batch, max_len)
                assert split_len % 128 == 0 and (splits - 1) * split_len < max_len <= splits * split_len

    @pytest.mark.parametrize("batch,heads,max_len,hd,convert,transposed", [
        (256, 32, 1536, 128, True, False), (128, 32, 2048, 128, True, False), (1, 32, 8192, 128, True, True),
        (8, 32, 8192, 128, True, True), (1, 192, 8192, 128, False, False), (64, 32, 2048, 256, False, False),
        (2, 32, 4096, 256, None, False)])
    def test_float8_default_tiling(self, batch, heads, max_len, hd, convert, transposed):
        """8-bit pages default to a converting warpgroup over 128-token blocks where it fits: with query rows for
        unsplit sequences at head_dim 128, with scores as K·qᵀ for split ones (not for a group that loads over 16 rows: 24 here);
        elsewhere the compute warpgroup converts, in a tiling that fits: the call lowers for CUDA, where Mosaic GPU
        checks the shared memory it allocates, with no block sizes given. A split sequence at head_dim 256 fits in
        no tiling: the call says so (convert None)."""
        from jax import export

        from pallas_kernels.paged_attention.mosaic_gpu import float8_block_sizes

        bs = float8_block_sizes(batch, 8, heads // 8, max_len, hd, 2)
        assert (bs.convert_warpgroup, bs.transposed) == (bool(convert), transposed)
        q = jax.ShapeDtypeStruct((batch, heads, hd), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((8, batch * max_len // PAGE_SIZE, PAGE_SIZE, hd), jnp.float8_e4m3fn)
        table = jax.ShapeDtypeStruct((batch, max_len // PAGE_SIZE), jnp.int32)
        fn = jax.jit(functools.partial(paged_attention, backend="mosaic_gpu", interpret=False))
        lower = functools.partial(export.export(fn, platforms=["cuda"]), q, pages, pages, table,
                                  jax.ShapeDtypeStruct((batch,), jnp.int32))
        if convert is None:
            with pytest.raises(ValueError, match="shared memory"):
                lower()
            return
        assert "mosaic_gpu" in lower().mlir_module()

    def test_shared_memory_limit_is_named(self):
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        pages = jnp.zeros((1, 8, PAGE_SIZE, 128), jnp.bfloat16)
        with pytest.raises(ValueError, match="shared memory"):
            paged_attention(jnp.zeros((2, 4, 128), jnp.bfloat16), pages, pages, jnp.zeros((2, 4), jnp.int32),
                            jnp.ones(2, jnp.int32), backend=self.backend, interpret=True,
                            block_sizes=BlockSizes(block_k=128, stages=3, slots_per_program=2))


class TestMosaicTPUInterpret(InterpretSuite):
    backend = "mosaic_tpu"
    FLOAT8 = False

    def block_sizes(self, case):
        """Several K/V blocks per split, so the double buffering runs; float32 takes half pages."""
        from pallas_kernels.paged_attention.mosaic_tpu import BlockSizes

        dtype, _, _, splits = case
        return BlockSizes(num_splits=splits, block_k=8 if dtype == "float32" else 32)

    def test_lowers_for_tpu(self):
        """The Pallas-to-Mosaic lowering (block shapes, primitives) runs here without a TPU."""
        from pallas_kernels.paged_attention.mosaic_tpu import BlockSizes

        args = (jnp.zeros((8, 32, 128), jnp.bfloat16), jnp.zeros((8, 512, 16, 128), jnp.bfloat16),
                jnp.zeros((8, 64), jnp.int32), jnp.zeros((8,), jnp.int32))
        for splits in (1, 4):
            bs = BlockSizes(num_splits=splits)
            fn = jax.jit(functools.partial(paged_attention, backend="mosaic_tpu", interpret=False, block_sizes=bs))
            lowered = fn.trace(args[0], args[1], args[1], *args[2:]).lower(lowering_platforms=("tpu",))
            assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.gpu
class TestMosaicGPU(MosaicGPUOptions, DecodeSuite):
    backend = "mosaic_gpu"
    interpret = False

    def block_sizes(self, case):
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        return BlockSizes(num_splits=case[3], slots_per_program=2 if case[3] == 1 else 1)
