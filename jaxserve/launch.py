"""Starting a model on this process's devices: the one path of `serve`, `batch`, `generate` and `bench`.

Every process of a multi-host group runs the same command. Each joins the group (`join`), loads the same weights
the same way (`load_model`: the same dtype and quantization on every process), and builds the same steps; the
leader (process 0) gets the engine, and a follower runs the leader's steps until it closes (`engine_or_follow`
returns None there). On one process there is no group, and the leader is all there is.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from typing import Any

from jaxserve.config import DistributedConfig, EngineConfig, QuantConfig

log = logging.getLogger("jaxserve")


def default_dtype() -> str:
    """float32 on a CPU, bfloat16 on a GPU or TPU."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def join(args: argparse.Namespace | None, base: DistributedConfig | None = None) -> bool:
    """Joins the multi-host group from `base`, the command's flags (--coordinator-address, --num-processes,
    --process-id) and the environment; True when there is more than one process. Call it before anything asks JAX
    for devices."""
    from jaxserve.parallel.distributed import initialize

    given = {name: getattr(args, name) for name in ("coordinator_address", "num_processes", "process_id")
             if getattr(args, name, None) is not None}
    return initialize(dataclasses.replace(base or DistributedConfig(), **given), os.environ)


def is_follower() -> bool:
    import jax

    return jax.process_index() != 0


def use_compilation_cache(engine: EngineConfig) -> None:
    """Turns on the persistent compilation cache of `engine.compilation_cache_dir`, before anything compiles: the
    loader's own computations (quantizing, random weights) are then read back on a restart too."""
    if engine.compilation_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", engine.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def load_model(path: str | None, *, dtype: str | None, quantize: QuantConfig | None, engine: EngineConfig) -> Any:
    """The model at `path` (None: the embedded one) in `dtype` (None: the platform's default), quantized as asked;
    on the host first when the engine shards it over several devices."""
    from jaxserve.checkpoint import load_model as load

    use_compilation_cache(engine)
    dtype = dtype or default_dtype()
    start = time.perf_counter()
    model = load(path, dtype=dtype, quantize=quantize, on_host=engine.parallel.num_devices > 1)
    log.info("loaded %s as %s%s in %.1f s", model.source, dtype, " (int8 weights)" if model.quantization else "",
             time.perf_counter() - start)
    return model


def engine_or_follow(model: Any, cfg: EngineConfig) -> Any:
    """The leader's engine for `model`, every bucket compiled; on a follower, runs the leader's steps until the
    leader closes and returns None."""
    from jaxserve.runner import StepRunner, build_engine

    if is_follower():
        StepRunner(model, cfg).follow()
        return None
    return build_engine(model, cfg)
