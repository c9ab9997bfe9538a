"""The paged KV cache: per layer, one pool of pages shared by every slot through page tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig


@dataclass(frozen=True)
class KVCache:
    """Per layer, K and V pages [kv_heads, pages, page_size, head_dim] (see pallas_kernels.paged_attention).

    With `padding_page`, the pool's last page belongs to no request: padding tokens (a bucket's empty
    rows, a chunk's tail) write their K/V there, so every write is in bounds. Without it they are
    dropped by an out-of-bounds index, which costs a select and an extra kernel per write when XLA
    turns a one-token scatter into an in-place update (two kernels per layer at batch 1). The engine
    keeps the page on one device; a pool split over devices (parallel) drops instead."""

    k: Any  # tuple over layers
    v: Any
    padding_page: bool = False

    @staticmethod
    def zeros(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, *, padding_page: bool = False) -> KVCache:
        """`num_pages` pages for requests, and with `padding_page` one more past them."""
        shape = (cfg.num_kv_heads, num_pages + int(padding_page), page_size, cfg.head_dim)
        return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)), padding_page=padding_page)

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def page_size(self) -> int:
        return int(self.k[0].shape[2])


def page_dtype(kv_cache_dtype: str, activations: Any) -> Any:
    """The KV pages' dtype for EngineConfig.kv_cache_dtype: "auto" is the activations' dtype."""
    from jaxserve.config import KV_CACHE_DTYPES
    from jaxserve.errors import InputError

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return jnp.dtype(activations) if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v"], meta_fields=["padding_page"])
