"""Backend selection for the kernels: which implementation runs, and whether it is interpreted.

Backends: "reference" (pure jnp), "mosaic_gpu" (Hopper), "mosaic_tpu", "pallas" (the Pallas
backend of the current platform; on CPU the Mosaic GPU kernels in interpret mode) and "auto"
(Mosaic GPU on a GPU, Mosaic TPU on a TPU, the reference elsewhere). "mosaic_gpu" and "mosaic_tpu"
named on a platform that cannot compile them run in interpret mode.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax

BACKENDS = ("auto", "pallas", "reference", "mosaic_gpu", "mosaic_tpu")
DEFAULT_SMS = 132  # an H100 or H200 SXM's: what the kernels size for off a GPU (interpret mode, the CPU tests)


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the default device, which the Mosaic GPU kernels size their splits and program
    orders for: a GPU's own count, elsewhere DEFAULT_SMS."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or DEFAULT_SMS) if device.platform == "gpu" else DEFAULT_SMS


def resolve(backend: str) -> str:
    """Maps "auto" and "pallas" to a concrete backend for the default device's platform."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend not in ("auto", "pallas"):
        return backend
    platform = jax.default_backend()
    if platform in ("gpu", "cuda"):
        return "mosaic_gpu"
    if platform == "tpu":
        return "mosaic_tpu"
    return "reference" if backend == "auto" else "mosaic_gpu"


@functools.cache
def _load_takes_index() -> bool:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


def gpu_load(ref: Any, **kwargs: Any) -> jax.Array:
    """`plgpu.load` of a whole (already indexed) shared-memory ref: jax 0.10 requires the index argument,
    0.11 deprecates it (the index goes in `ref.at[...]`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.load(ref, (), **kwargs) if _load_takes_index() else plgpu.load(ref, **kwargs)


def interpret_params(backend: str, interpret: bool | None) -> Any:
    """The `interpret=` argument for a Pallas call: None to compile, else the interpreter's params.

    `interpret=None` interprets exactly when the platform cannot compile the backend (on CPU).
    """
    if interpret is None:
        native = {"mosaic_gpu": ("gpu", "cuda"), "mosaic_tpu": ("tpu",)}[backend]
        interpret = jax.default_backend() not in native
    if not interpret:
        return None
    if backend == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    from pallas_kernels.compat import interpret_gpu_params

    return interpret_gpu_params()


def interpreted(backend: str) -> bool:
    """Whether `backend`'s Pallas kernels run in interpret mode on this platform."""
    resolved = resolve(backend)
    return resolved != "reference" and interpret_params(resolved, None) is not None


def implementation(package: str, backend: str) -> Any:
    """The module of `package` (e.g. "pallas_kernels.paged_attention") that implements `backend`."""
    import importlib
    import importlib.util

    return importlib.import_module(f"{package}.{resolve(backend)}")
