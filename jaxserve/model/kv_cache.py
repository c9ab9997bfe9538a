"""A contiguous KV cache: one [max_len] strip per batch row. The paged cache replaces it in the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.weights import pytree_dataclass


@pytree_dataclass
@dataclass(frozen=True)
class KVCache:
    k: Any  # tuple over layers of [batch, max_len, kv_heads, head_dim]
    v: Any

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, dtype: Any) -> KVCache:
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))

    @property
    def max_len(self) -> int:
        return int(self.k[0].shape[1])


def cache_bytes(cache: KVCache) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
