"""Pure-jnp int8-weight matmul: the numerical reference of the kernels, and the XLA path.

Weights are output-major: `values` int8 [n, k] (row j holds output channel j's k inputs) and
`scales` float32 [groups, n], so that the float weight is `values[j, i] * scales[i // (k // groups), j]`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_CONTRACT_K = (((1,), (1,)), ((), ()))  # x [m, k] · values [n, k] over k


def quantized_matmul(
    x: jax.Array,  # [m, k] float
    values: jax.Array,  # [n, k] int8
    scales: jax.Array,  # [groups, n] float32
    *,
    out_dtype: Any = None,
    block_sizes: Any = None,
    interpret: bool | None = None,
) -> jax.Array:  # [m, n] out_dtype (default x.dtype)
    """x times the dequantized weight, accumulated in float32.

    Per-channel scales (one group) multiply the product, so the int8 values are only converted to
    x's dtype (exactly: |v| <= 127 fits bfloat16's 8-bit mantissa) and XLA may fuse the convert into
    the dot. Per-group scales are applied to the weight first.
    """
    del block_sizes, interpret
    n, k = values.shape
    groups = scales.shape[0]
    if groups == 1:
        y = lax.dot_general(x, values.astype(x.dtype), _CONTRACT_K, preferred_element_type=jnp.float32)
        y = y * scales[0].astype(jnp.float32)
    else:
        w = values.reshape(n, groups, k // groups).astype(jnp.float32) * scales.T[:, :, None].astype(jnp.float32)
        y = lax.dot_general(x, w.reshape(n, k).astype(x.dtype), _CONTRACT_K, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)
