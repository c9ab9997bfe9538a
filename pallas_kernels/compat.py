"""Every private JAX import of the project, in one module: a JAX release that moves one of them breaks only this
file, and each use says what it needs from the private module."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def interpret_gpu_params() -> Any:
    """Mosaic GPU's interpreter parameters (`plgpu.kernel(interpret=...)`), reached only through this module."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def interpreter_thread_map() -> ModuleType | None:
    """The module that runs an interpreted kernel's threads (tests/conftest.py compiles each thread body once);
    None where this JAX has no such module."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return None
    return thread_map


def eval_jaxpr(jaxpr: Any, consts: Any, *args: Any) -> Any:
    from jax._src import core

    return core.eval_jaxpr(jaxpr, consts, *args)
