"""The paged KV cache: per layer, one pool of pages shared by every slot through page tables."""

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
    k: Any  # tuple over layers of [kv_heads, num_pages, page_size, head_dim] (see pallas_kernels.paged_attention)
    v: Any

    @staticmethod
    def zeros(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any) -> KVCache:
        shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def page_size(self) -> int:
        return int(self.k[0].shape[2])


def cache_bytes(cache: KVCache) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
