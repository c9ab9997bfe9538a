"""One paged decode-attention suite, run by every backend (see test_flash_attention)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.paged_attention import paged_attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PAGE_SIZE = 16


class DecodeSuite:
    backend = "reference"
    interpret: bool | None = None
    kv_heads = 2
    pages_per_row = 24
    CASES = [(d, hd, g, s) for d, hd, g, s in itertools.product(DTYPES, (64, 128), (1, 4, 8), (1, 3))]

    def block_sizes(self, splits: int):
        return None

    def test_ragged_slots(self, case):
        """Slots of lengths 1, page_size + 1, full and 0 over random pages; s splits of the sequence."""
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
        out = paged_attention(q, kp, vp, jnp.asarray(table), jnp.asarray(lengths), backend=self.backend,
                              interpret=self.interpret, block_sizes=self.block_sizes(splits))
        k = testing.dense_from_pages(np.asarray(kp.astype(jnp.float32)), table)
        v = testing.dense_from_pages(np.asarray(vp.astype(jnp.float32)), table)
        truth = testing.attention_truth(q.astype(jnp.float32)[:, None], k, v, lengths - 1, lengths, causal=False)[:, 0]
        assert out.shape == q.shape and out.dtype == q.dtype
        assert np.all(np.asarray(out[3], np.float32) == 0.0), "an empty slot returns zeros"
        assert testing.relative_error(out, truth) < testing.tolerance(self.backend, dtype)


class TestReference(DecodeSuite):
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
    CASES = [("bfloat16", 64, 1, 1), ("float32", 128, 4, 2), ("bfloat16", 128, 8, 1)]


class TestMosaicGPUInterpret(InterpretSuite):
    backend = "mosaic_gpu"

    def block_sizes(self, splits: int):
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        return BlockSizes(num_splits=splits)


@pytest.mark.skip(reason="the Mosaic TPU kernels are not written yet (issue 5, left undone)")
class TestMosaicTPUInterpret(InterpretSuite):
    backend = "mosaic_tpu"


@pytest.mark.gpu
class TestMosaicGPU(DecodeSuite):
    backend = "mosaic_gpu"
    interpret = False

    def block_sizes(self, splits: int):
        from pallas_kernels.paged_attention.mosaic_gpu import BlockSizes

        return BlockSizes(num_splits=splits)
