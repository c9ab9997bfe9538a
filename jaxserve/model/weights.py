"""Weights as registered pytree dataclasses that describe themselves once.

`Weights.abstract(cfg)` returns the same tree with an `ArraySpec` (shape, logical axes) at every
leaf. Random init, checkpoint loading and (later) sharding all derive from that one tree, so a
new weight is added in exactly one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig


@dataclass(frozen=True)
class ArraySpec:
    """Shape and logical axis names of one weight; a leaf of the abstract tree."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"  # "normal" (scaled by fan-in) or "ones" (norm gains)

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


T = TypeVar("T")


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Registers a dataclass as a pytree whose every field is a child."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@pytree_dataclass
@dataclass(frozen=True)
class Layer:
    """One decoder block. Projections are stored [out, in] (the Hugging Face layout) and keep heads as
    axes: wq is [q_heads, head_dim, embed], wo is [embed, q_heads, head_dim]."""

    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any  # [embed, q_heads, head_dim]
    bq: Any  # [q_heads, head_dim] or None
    bk: Any
    bv: Any
    mlp_norm: Any
    w_gate: Any  # [ffn, embed]
    w_up: Any
    w_down: Any  # [embed, ffn]

    @staticmethod
    def abstract(cfg: ModelConfig) -> Layer:
        d, h, kv, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        bias = cfg.attention_bias
        return Layer(
            attn_norm=ArraySpec((d,), ("embed",), "ones"),
            wq=ArraySpec((h, hd, d), ("q_heads", "head_dim", "embed")),
            wk=ArraySpec((kv, hd, d), ("kv_heads", "head_dim", "embed")),
            wv=ArraySpec((kv, hd, d), ("kv_heads", "head_dim", "embed")),
            wo=ArraySpec((d, h, hd), ("embed", "q_heads", "head_dim")),
            bq=ArraySpec((h, hd), ("q_heads", "head_dim")) if bias else None,
            bk=ArraySpec((kv, hd), ("kv_heads", "head_dim")) if bias else None,
            bv=ArraySpec((kv, hd), ("kv_heads", "head_dim")) if bias else None,
            mlp_norm=ArraySpec((d,), ("embed",), "ones"),
            w_gate=ArraySpec((f, d), ("ffn", "embed")),
            w_up=ArraySpec((f, d), ("ffn", "embed")),
            w_down=ArraySpec((d, f), ("embed", "ffn")),
        )


@pytree_dataclass
@dataclass(frozen=True)
class Weights:
    """The whole decoder. `lm_head` is None when the output head is tied to the embedding."""

    embed: Any  # [vocab, embed]
    layers: Any  # tuple[Layer, ...]
    final_norm: Any  # [embed]
    lm_head: Any  # [vocab, embed] or None

    @staticmethod
    def abstract(cfg: ModelConfig) -> Weights:
        d, v = cfg.hidden_size, cfg.vocab_size
        return Weights(
            embed=ArraySpec((v, d), ("vocab", "embed")),
            layers=tuple(Layer.abstract(cfg) for _ in range(cfg.num_layers)),
            final_norm=ArraySpec((d,), ("embed",), "ones"),
            lm_head=None if cfg.tie_word_embeddings else ArraySpec((v, d), ("vocab", "embed")),
        )


def is_spec(x: Any) -> bool:
    return isinstance(x, ArraySpec)


def random_weights(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Weights:
    """Random weights in real shapes (for tests and speed work), fan-in scaled so activations stay O(1)."""
    specs, treedef = jax.tree_util.tree_flatten(Weights.abstract(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(specs))

    def init(spec: ArraySpec, k: jax.Array) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        # Every matrix is [out..., in...]: the input is the last axis, or (q_heads, head_dim) for wo.
        fan_in = spec.shape[-1] * (spec.shape[-2] if spec.axes[-1] == "head_dim" else 1)
        return (jax.random.normal(k, spec.shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)

    return jax.tree_util.tree_unflatten(treedef, [init(s, k) for s, k in zip(specs, keys)])


def check_shapes(cfg: ModelConfig, weights: Weights) -> None:
    """Raises ValueError naming the first weight whose shape differs from the config's."""
    specs = jax.tree_util.tree_flatten_with_path(Weights.abstract(cfg), is_leaf=is_spec)[0]
    leaves = jax.tree_util.tree_flatten_with_path(weights)[0]
    if len(specs) != len(leaves):
        raise ValueError(f"weights have {len(leaves)} arrays, the config describes {len(specs)}")
    for (path, spec), (_, leaf) in zip(specs, leaves):
        if tuple(leaf.shape) != spec.shape:
            raise ValueError(
                f"weight {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, config expects {spec.shape}"
            )


def param_bytes(weights: Weights) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(weights))


def cast(weights: Weights, dtype: Any) -> Weights:
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), weights)
