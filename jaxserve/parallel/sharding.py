"""Logical-axis rules: every weight and cache axis has a name (`Weights.abstract`, `CACHE_AXES`), and
one table maps each name to a mesh axis or to None (kept whole on every device).

A quantized weight (`QuantizedArray`) shards its int8 values like the float weight and its scales
along the same output axes; per-group scales keep their groups whole.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.model.config import ModelConfig
from jaxserve.model.quant import GROUPS_AXIS, QuantizedArray, quantized_spec
from jaxserve.model.weights import Weights, is_spec

Rules = Sequence[tuple[str, str | None]]

RULES: Rules = (
    ("vocab", "model"),
    ("embed", None),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("qkv", None),  # within a KV head's group of wqkv: its query heads, key and value
    ("ffn", "model"),
    ("gate_up", None),
    ("experts", "expert"),  # a mixture's experts, each whole on its device of `expert` (its ffn over `model`)
    ("router", None),  # the router's rows, one per expert: every device routes every token
    ("pages", "seq"),  # the KV cache: each device of `seq` holds one block of the page pool
    ("page_size", None),
    ("batch", None),
    ("tokens", "seq"),  # a prefill chunk's tokens
    (GROUPS_AXIS, None),  # per-group int8 scales: small, kept whole
)
CACHE_AXES = ("kv_heads", "pages", "page_size", "head_dim")  # of KVCache.k[i] and .v[i]


def check_rules(rules: Rules, mesh_axes: Sequence[str]) -> None:
    """Raises ValueError for a logical axis named twice or a mesh axis the mesh does not have."""
    names = [name for name, _ in rules]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ValueError(f"logical axes {doubled} have more than one rule")
    bad = sorted({str(m) for _, m in rules if m is not None and m not in mesh_axes})
    if bad:
        raise ValueError(f"rules name mesh axes {bad}; the mesh has {tuple(mesh_axes)}")


def logical_spec(axes: Sequence[str], shape: Sequence[int], mesh: Mesh, rules: Rules = RULES) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes. Two axes of one array on the same mesh axis
    is an error (a collision); a dimension its mesh axis does not divide is kept whole."""
    table = dict(rules)
    missing = [a for a in axes if a not in table]
    if missing:
        raise ValueError(f"no sharding rule for logical axes {missing}; the rules cover {sorted(table)}")
    mapped = [table[a] for a in axes]
    for m in {m for m in mapped if m is not None}:
        if mapped.count(m) > 1:
            clash = [a for a, n in zip(axes, mapped) if n == m]
            raise ValueError(f"logical axes {clash} of one array {tuple(axes)} both map to mesh axis {m!r}")
    return PartitionSpec(*(m if m is not None and mesh.shape[m] > 1 and size % mesh.shape[m] == 0 else None
                           for m, size in zip(mapped, shape)))


def weight_shardings(weights: Weights, cfg: ModelConfig, mesh: Mesh, rules: Rules = RULES) -> Any:
    """The tree of NamedShardings for `weights` (same structure), from `Weights.abstract(cfg)`'s axes.
    A quantized leaf gets a QuantizedArray of shardings: its values follow the float weight's axes,
    its scales the output axes (see `quantized_spec`)."""
    def named(spec: Any) -> NamedSharding:
        return NamedSharding(mesh, logical_spec(spec.axes, spec.shape, mesh, rules))

    def leaf(spec: Any, w: Any) -> Any:
        if isinstance(w, QuantizedArray):
            return jax.tree_util.tree_map(named, quantized_spec(spec, w.in_ndim, w.group_size), is_leaf=is_spec)
        return named(spec)

    return jax.tree_util.tree_map(leaf, Weights.abstract(cfg), weights, is_leaf=is_spec)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """One array onto the mesh. With several processes each one holds the whole value and gives its own shards."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_weights(weights: Weights, cfg: ModelConfig, mesh: Mesh, rules: Rules = RULES) -> Weights:
    """The weights laid out on the mesh by the rules."""
    return jax.tree_util.tree_map(put, weights, weight_shardings(weights, cfg, mesh, rules))


def kv_heads_for(num_kv_heads: int, tp: int) -> int:
    """How many KV heads the sharded model keeps: the least multiple of the model's that `tp` divides.
    With tp above (or not dividing) the KV heads, each head is repeated so that every device holds
    the heads its query heads read, instead of refusing the mesh."""
    return math.lcm(num_kv_heads, tp)


def replicate_kv_heads(weights: Weights, cfg: ModelConfig, tp: int) -> tuple[Weights, ModelConfig]:
    """Repeats each KV head r = kv_heads_for(kv, tp) / kv times in wqkv (and its bias): each copy takes
    a consecutive 1/r of the head's query heads, so query head i keeps reading the same key and value,
    now those of head i // (heads / (kv * r)). Returns weights and config as is when r is 1."""
    kv = cfg.num_kv_heads
    r = kv_heads_for(kv, tp) // kv
    if r == 1:
        return weights, cfg
    group = cfg.num_heads // kv

    def regroup(x: Any, axis: int) -> Any:
        # [..., kv, group + 2, ...] (kv at `axis`) -> [..., kv * r, group / r + 2, ...]
        xp = np if isinstance(x, np.ndarray) else jnp
        shape = x.shape
        q = x[(slice(None),) * (axis + 1) + (slice(0, group),)]
        q = q.reshape(*shape[:axis], kv * r, group // r, *shape[axis + 2:])
        kv_rows = xp.repeat(x[(slice(None),) * (axis + 1) + (slice(group, group + 2),)], r, axis=axis)
        return xp.concatenate([q, kv_rows], axis=axis + 1)

    def fused(w: Any) -> Any:
        if w is None:
            return None
        if isinstance(w, QuantizedArray):  # values [kv, g + 2, hd, embed], scales [groups, kv, g + 2, hd]
            return dataclasses.replace(w, values=regroup(w.values, 0), scales=regroup(w.scales, 1))
        return regroup(w, 0)

    def layer(w: Any) -> Any:
        return dataclasses.replace(w, wqkv=fused(w.wqkv), bqkv=fused(w.bqkv))

    return (dataclasses.replace(weights, layers=tuple(layer(w) for w in weights.layers)),
            dataclasses.replace(cfg, num_kv_heads=kv * r))
