"""The device mesh (axes `data`, `seq`, `expert`, `model`) and `MeshPlan`: a model and its engine laid out on one.

`model` is the innermost axis, so tensor-parallel peers are the closest devices (one host, NVLink); `expert`
comes next, so the partial sums of experts spread over it add up between close devices too (jaxserve.parallel.
experts); then `seq`, so a sequence spread over hosts passes its K/V blocks between neighbours.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ParallelConfig
from jaxserve.engine.batch import StepInput
from jaxserve.errors import JaxserveError
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.weights import Weights
from jaxserve.parallel import sharding
from jaxserve.parallel.attention import MeshAttention
from jaxserve.parallel.experts import experts_on_mesh
from jaxserve.parallel.ring import zigzag_order

log = logging.getLogger(__name__)

AXES = ("data", "seq", "expert", "model")
TOKEN_INPUTS = ("tokens", "positions", "valid", "targets")  # the StepInput arrays of shape [rows, width]


def make_mesh(parallel: ParallelConfig, devices: list[Any] | None = None) -> Mesh:
    """A (dp, sp, ep, tp) mesh over the first dp * sp * ep * tp devices; with several processes, over all of them."""
    devices = list(jax.devices()) if devices is None else list(devices)
    need = parallel.num_devices
    if need > len(devices):
        raise JaxserveError(
            f"--tp {parallel.tp} --sp {parallel.sp} --ep {parallel.ep} --dp {parallel.dp} needs {need} devices, but only "
            f"{len(devices)} {devices[0].platform.upper()} devices are visible; lower tp, sp, ep or dp so that their "
            f"product is at most {len(devices)}")
    if jax.process_count() > 1 and need != len(devices):
        raise JaxserveError(
            f"with {jax.process_count()} processes the mesh must use every device: tp * sp * ep * dp = {need}, but there "
            f"are {len(devices)} devices in all")
    return jax.make_mesh((parallel.dp, parallel.sp, parallel.ep, parallel.tp), AXES,
                         axis_types=(AxisType.Auto,) * len(AXES), devices=devices[:need])


def check_model(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Tensor parallelism splits the query heads: tp must divide them (KV heads are repeated as needed). Expert
    parallelism splits the experts: ep must divide them. Ring attention (sp) takes no window or soft-cap."""
    if cfg.num_heads % parallel.tp:
        fits = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
        raise JaxserveError(f"--tp {parallel.tp} does not divide the model's {cfg.num_heads} query heads; "
                            f"use a tp among {fits}")
    if parallel.ep > 1 and not cfg.num_experts:
        raise JaxserveError(f"--ep {parallel.ep}: this {cfg.architecture} model has no experts to split; use ep 1")
    if cfg.num_experts % parallel.ep:
        fits = [d for d in range(1, cfg.num_experts + 1) if cfg.num_experts % d == 0]
        raise JaxserveError(f"--ep {parallel.ep} does not divide the model's {cfg.num_experts} experts "
                            f"({cfg.architecture}); use an ep among {fits}")
    if parallel.sp > 1 and (cfg.sliding_window is not None or cfg.attn_softcap is not None):
        raise JaxserveError(f"--sp {parallel.sp}: ring attention takes no sliding window or soft-capped scores, which "
                            f"this {cfg.architecture} model has; use sp 1 (tp and ep split it instead)")


@dataclass(frozen=True)
class MeshPlan:
    """Where everything of a sharded engine lives: the mesh, the (KV-replicated) model on it, the cache
    layout, the step inputs' layout and the attention function the step runs."""

    mesh: Mesh
    model_cfg: ModelConfig  # num_kv_heads as sharded (see sharding.kv_heads_for)
    weights: Weights
    attention: MeshAttention
    engine_cfg: EngineConfig

    @staticmethod
    def build(model_cfg: ModelConfig, weights: Weights, cfg: EngineConfig, devices: list[Any] | None = None) -> MeshPlan:
        parallel = cfg.parallel
        if parallel.dp > 1:
            raise JaxserveError(
                f"--dp {parallel.dp}: one engine serves one data-parallel replica; run dp engines (replicas of the "
                f"server, or shards of a batch job) with --dp 1")
        check_model(model_cfg, parallel)
        mesh = make_mesh(parallel, devices)
        weights, sharded_cfg = sharding.replicate_kv_heads(weights, model_cfg, parallel.tp)
        if sharded_cfg.num_kv_heads != model_cfg.num_kv_heads:
            log.info("tp=%d: each of the %d KV heads is repeated %d times", parallel.tp, model_cfg.num_kv_heads,
                     sharded_cfg.num_kv_heads // model_cfg.num_kv_heads)
        placed = experts_on_mesh(sharding.shard_weights(weights, sharded_cfg, mesh), mesh)
        log.info("mesh %s over %d devices", dict(mesh.shape), mesh.size)
        return MeshPlan(mesh, sharded_cfg, placed, MeshAttention(mesh, cfg.attention), cfg)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def cache_sharding(self, num_pages: int, page_size: int) -> NamedSharding:
        shape = (self.model_cfg.num_kv_heads, num_pages, page_size, self.model_cfg.head_dim)
        return self.sharding(sharding.logical_spec(sharding.CACHE_AXES, shape, self.mesh))

    def zeros_cache(self, num_pages: int, page_size: int, dtype: Any) -> KVCache:
        """The KV cache, created in place on the mesh: no device ever holds more than its share."""
        layer = self.cache_sharding(num_pages, page_size)
        shardings = KVCache(k=(layer,) * self.model_cfg.num_layers, v=(layer,) * self.model_cfg.num_layers)
        make = jax.jit(lambda: KVCache.zeros(self.model_cfg, num_pages, page_size, dtype), out_shardings=shardings)
        return make()

    def input_shardings(self, bucket: tuple[int, int, int]) -> dict[str, NamedSharding]:
        """A prefill chunk's tokens are spread over `seq` (in the order `reorder` gives); the rest is replicated."""
        spread = bucket[1] > 1 and self.mesh.shape["seq"] > 1
        tokens = sharding.logical_spec(("batch", "tokens"), bucket[:2], self.mesh) if spread else P()
        example = StepInput.build([None], 1, 1, 1)
        return {name: self.sharding(tokens if name in TOKEN_INPUTS else P()) for name in vars(example)}

    def reorder(self, inp: StepInput) -> StepInput:
        """A prefill chunk in zig-zag order over `seq` (host side). The model is driven by positions, so only
        the index of the sampled token changes."""
        n, width = self.mesh.shape["seq"], inp.tokens.shape[1]
        if n == 1 or width == 1:
            return inp
        order = zigzag_order(width, n)
        where = np.argsort(order).astype(np.int32)
        return dataclasses.replace(inp, **{name: getattr(inp, name)[:, order] for name in TOKEN_INPUTS},
                                   last=where[inp.last])

    def restore_order(self, x: np.ndarray) -> np.ndarray:
        """Per-position results [rows, width, ...] of a reordered chunk, back in position order."""
        n, width = self.mesh.shape["seq"], x.shape[1]
        return x if n == 1 or width == 1 else x[:, np.argsort(zigzag_order(width, n))]

    def replicated(self) -> NamedSharding:
        return self.sharding(P())
