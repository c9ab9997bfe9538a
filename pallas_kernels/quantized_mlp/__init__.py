"""int8 SiLU-gated MLP for decode: down(silu(r · gate(x)) · r · up(x)) with int8 weights, as one kernel.

`backend`: "auto" (the Mosaic GPU kernel on a GPU for the shapes it takes, XLA otherwise), "mosaic_gpu",
"reference" (XLA: the int8 matmul's reference twice). Weights as the model stores them: gate_up values
[f, 2, d] with per-channel scales [1, f, 2], down values [d, f] with scales [1, d].
"""

from __future__ import annotations

import jax

from pallas_kernels import backend as backend_lib
from pallas_kernels.quantized_mlp.reference import gate_up_silu as gate_up_silu_reference
from pallas_kernels.quantized_mlp.reference import quantized_mlp as quantized_mlp_reference


def _kernel_takes(name: str, m: int, d: int, f: int, groups: int, backend: str) -> bool:
    """Whether `backend` runs mosaic_gpu.<name> for these shapes (per-channel scales, decode's few rows, a GPU)."""
    if backend_lib.resolve(backend) != "mosaic_gpu" or groups != 1 or backend_lib.interpreted("mosaic_gpu"):
        return False
    from pallas_kernels.quantized_mlp import mosaic_gpu

    return {"quantized_mlp": mosaic_gpu.supports, "gate_up_silu": mosaic_gpu.supports_gate_up_silu}[name](m, d, f)


def _on_kernel(name: str, x: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, backend: str) -> bool:
    """Whether a call of `name` with `backend` goes to the Mosaic GPU kernel (else to the reference)."""
    if backend not in ("auto", "reference", "mosaic_gpu"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'reference' or 'mosaic_gpu'")
    f = gu_values.shape[0]
    return backend == "mosaic_gpu" or (backend == "auto" and _kernel_takes(
        name, x.shape[0], x.shape[1], f, gu_scales.size // f // 2, backend))


def supports(m: int, d: int, f: int, groups: int, backend: str = "auto") -> bool:
    """Whether `backend` runs this MLP as one kernel (per-channel scales, decode's few rows, a GPU)."""
    return _kernel_takes("quantized_mlp", m, d, f, groups, backend)


def quantized_mlp(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, down_values: jax.Array,
                  down_scales: jax.Array, *, backend: str = "auto", **kwargs) -> jax.Array:
    """[m, d] float32; see reference.quantized_mlp."""
    if not _on_kernel("quantized_mlp", x, gu_values, gu_scales, backend):
        return quantized_mlp_reference(x, r, gu_values, gu_scales, down_values, down_scales)
    from pallas_kernels.quantized_mlp import mosaic_gpu

    return mosaic_gpu.quantized_mlp(x, r, gu_values, gu_scales, down_values, down_scales, **kwargs)


def gate_up_silu(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, *, backend: str = "auto",
                 **kwargs) -> jax.Array:
    """act = silu(r · gate(x)) · r · up(x) [m, f] in x's dtype; see reference.gate_up_silu. On a GPU for the shapes
    it takes, one Mosaic GPU kernel (the fused MLP's gate items alone: SiLU·up in gate_up's epilogue); else XLA."""
    if not _on_kernel("gate_up_silu", x, gu_values, gu_scales, backend):
        return gate_up_silu_reference(x, r, gu_values, gu_scales)
    from pallas_kernels.quantized_mlp import mosaic_gpu

    return mosaic_gpu.gate_up_silu(x, r, gu_values, gu_scales, **kwargs)


__all__ = ["gate_up_silu", "gate_up_silu_reference", "quantized_mlp", "quantized_mlp_reference", "supports"]
