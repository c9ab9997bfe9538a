"""A decode step's every decoder layer in one persistent kernel (batch 1): its math and layouts.

`reference` holds the stacked layouts (`stack_layers`, `stack_pages`) and the math in jnp; `mosaic_gpu` the kernel
for Hopper, its parts in the modules beside it (`benchmarks/int8_gpu.py --variants int8,int8_megakernel` times
its step against the engine's int8 step).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel.reference import StackedLayers, stack_layers, stack_pages


def decode_layers(cfg: Any, st: StackedLayers, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                  page_table: jax.Array, lengths: jax.Array, inv_freq: np.ndarray, page_size: int, *,
                  backend: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every decoder layer of a decode step (see reference.decode_layers) -> (h, k_pages, v_pages). `backend`:
    "reference" (jnp), "mosaic_gpu" (the kernel: one row, Llama-8B-like shapes), "auto" the kernel on a GPU."""
    name = backend_lib.resolve(backend)
    if name not in ("reference", "mosaic_gpu"):
        raise ValueError(f"the decode megakernel has no {name} implementation (backend={backend!r})")
    module = backend_lib.implementation(__name__, name)
    return module.decode_layers(cfg, st, x, k_pages, v_pages, page_table, lengths, inv_freq, page_size)


def check_config(cfg: Any, page_size: int, page_dtype: Any, *, backend: str = "auto") -> None:
    """Raises ValueError naming what of the model or the pages `backend`'s implementation does not take (the
    reference takes any; mosaic_gpu.check_config says what the kernel takes)."""
    name = backend_lib.resolve(backend)
    if name == "mosaic_gpu":
        backend_lib.implementation(__name__, name).check_config(cfg, page_size, page_dtype)


__all__ = ["StackedLayers", "check_config", "decode_layers", "stack_layers", "stack_pages"]
