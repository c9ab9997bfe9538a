"""int8-weight matmul for decode: x [m, k] (bfloat16/float32) times int8 values [n, k] with scales.

Weights are output-major (`values` [n, k], `scales` float32 [groups, n]; see reference.py), so
each output channel's int8 row is contiguous: the kernels stream weight tiles of
[channels, block_k] with bulk copies and dequantize them on chip.

`backend`: "auto" (the platform's kernel for the decode shapes it takes, XLA otherwise),
"pallas" (the platform's kernel; on CPU the Mosaic GPU one, interpreted), "reference" (XLA),
"mosaic_gpu", "mosaic_tpu".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backend_lib
from pallas_kernels.quantized_matmul.reference import quantized_matmul as quantized_matmul_reference

MAX_KERNEL_ROWS = 128  # "auto" sends products of more rows (prefill chunks: compute-bound) to XLA


def row_multiple(backend: str = "auto") -> int:
    """The row count a kernel pads each product's activations to a multiple of (1: none). A caller that runs
    many products on the same rows, like a decode step, pads its rows once instead of once per product."""
    return getattr(backend_lib.implementation(__name__, backend), "ROW_MULTIPLE", 1)


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: Any = None,
                     backend: str = "auto", block_sizes: Any = None, interpret: bool | None = None) -> jax.Array:
    """x [m, k] times the weight `values` [n, k] int8 scaled by `scales` [groups, n] -> [m, n].

    out[i, j] = sum over groups g of scales[g, j] * sum over k in g of x[i, k] * values[j, k],
    accumulated in float32 and returned as `out_dtype` (default x's dtype).
    """
    if x.ndim != 2 or values.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"expected x [m, k], values [n, k], scales [groups, n]; got {x.shape=} {values.shape=} "
                         f"{scales.shape=}")
    if values.dtype != jnp.int8:
        raise ValueError(f"values must be int8, got {values.dtype}")
    n, k = values.shape
    if x.shape[1] != k:
        raise ValueError(f"x has k={x.shape[1]} inputs, values have k={k}")
    if scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales.shape={scales.shape} must be [groups, n={n}] with groups dividing k={k}")
    name = backend_lib.resolve(backend)
    if backend == "auto" and name != "reference":
        module = backend_lib.implementation(__name__, name)
        if x.shape[0] > MAX_KERNEL_ROWS or not module.supports(x.shape[0], n, k, k // scales.shape[0], x.dtype):
            name = "reference"
    module = backend_lib.implementation(__name__, name)
    return module.quantized_matmul(x, values, scales, out_dtype=out_dtype, block_sizes=block_sizes,
                                   interpret=interpret)


__all__ = ["MAX_KERNEL_ROWS", "quantized_matmul", "quantized_matmul_reference", "row_multiple"]
