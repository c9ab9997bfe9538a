"""Pure-jnp int8 MLP (SiLU-gated, Llama's): the numerical reference of the fused kernel, and the XLA path.

gate_up `values` int8 [f, 2, d] (channel j's gate row then its up row, as the model stores them) with
per-channel `scales` float32 [1, f, 2]; down `values` int8 [d, f] with `scales` [1, d] (see
pallas_kernels.quantized_matmul.reference for the layout). `r` [m] multiplies the gate_up product's rows
before the SiLU (a norm's 1/rms, which the model applies to the product's output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul.reference import quantized_matmul


def gate_up_silu(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, *,
                 interpret: bool | None = None) -> jax.Array:
    """silu(r · gate(x)) · r · up(x) [m, f] in x's dtype (computed in float32): x [m, d], r [m] float32."""
    del interpret
    f, _, d = gu_values.shape
    gu = quantized_matmul(x, gu_values.reshape(2 * f, d), gu_scales.reshape(1, 2 * f), out_dtype=jnp.float32)
    gu = gu.reshape(-1, f, 2) * r.astype(jnp.float32)[:, None, None]
    return (jax.nn.silu(gu[..., 0]) * gu[..., 1]).astype(x.dtype)


def quantized_mlp(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, down_values: jax.Array,
                  down_scales: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """down(silu(r · gate(x)) · r · up(x)) in float32 [m, d]: x [m, d] bfloat16 or float32, r [m] float32."""
    act = gate_up_silu(x, r, gu_values, gu_scales, interpret=interpret)
    return quantized_matmul(act, down_values, down_scales, out_dtype=jnp.float32)
