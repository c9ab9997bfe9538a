"""int8-weight matmul for TPU in Pallas Mosaic TPU: int8 weight blocks dequantized in VMEM, MXU products.

The grid is (m blocks, n blocks, k blocks) with k innermost, so each program streams its weight
rows block by block (the pipeline double-buffers them) into a float32 VMEM accumulator. A k block
lies inside one scale group, so its product is scaled by that group's scales as it is added.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend as backend_lib

_CONTRACT_K = (((1,), (1,)), ((), ()))
ROW_MULTIPLE = 16  # activation rows are padded to the bfloat16 sublane tile (a multiple of float32's 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic TPU quantized matmul (None: the largest of 512, 256, 128 that divides)."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None


def supports(m: int, n: int, k: int, group_size: int, dtype: Any) -> bool:
    del m, n, k, group_size
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _fit(size: int, limit: int) -> int:
    """The largest of 512, 256, 128 (at most `limit`) dividing `size`; else `size` (a whole-axis block)."""
    return next((b for b in (512, 256, 128) if b <= limit and size % b == 0), size)


def _kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, block_k: int, group: int):
    # x_ref: [block_m, block_k]; w_ref: [block_n, block_k] int8; s_ref: [groups, block_n] f32
    # o_ref: [block_m, block_n]; acc_ref: [block_m, block_n] f32 scratch
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    w = w_ref[...].astype(x_ref.dtype)  # exact: |v| <= 127
    part = lax.dot_general(x_ref[...], w, _CONTRACT_K, preferred_element_type=jnp.float32)
    g = (kk * block_k) // group
    acc_ref[...] += part * s_ref[pl.ds(g, 1), :]

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: Any = None,
                     block_sizes: BlockSizes | None = None, interpret: bool | None = None) -> jax.Array:
    """x [m, k] times int8 values [n, k] with scales [groups, n] (see reference.quantized_matmul)."""
    m, k = x.shape
    n = values.shape[0]
    groups = scales.shape[0]
    group = k // groups
    bs = block_sizes or BlockSizes()
    rows = ROW_MULTIPLE * 2 // jnp.dtype(x.dtype).itemsize  # sublane tile of the activations' dtype (16 or 8)
    block_m = bs.block_m or min(-(-m // rows) * rows, 256)
    block_n = bs.block_n or _fit(n, 512)
    block_k = bs.block_k or _fit(group, 512)
    if n % block_n or k % block_k or group % block_k:
        raise ValueError(f"block_n={block_n} must divide n={n}, and block_k={block_k} divide k={k} and the scale "
                         f"group {group}")
    m_pad = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, group=group),
        grid=(m_pad // block_m, n // block_n, k // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((block_n, block_k), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((groups, block_n), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), jnp.dtype(out_dtype or x.dtype)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=backend_lib.interpret_params("mosaic_tpu", interpret),
    )(xp, values, scales.astype(jnp.float32))
    return out[:m]
