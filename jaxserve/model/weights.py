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

from jaxserve.model.config import ModelConfig


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


@dataclass(frozen=True)
class Experts:
    """A layer's mixture of experts (ModelConfig.num_experts): `router` [experts, embed], and each expert's gated MLP
    as `gate_up` [experts, moe_ffn, 2, embed] and `down` [experts, embed, moe_ffn] (Layer's layouts, an expert axis
    ahead). `mesh` is where the experts are spread (jaxserve.parallel.experts; None: one device): a static field, so
    the model's one call (jaxserve.model.moe.moe_mlp) dispatches on the weights' type as a quantized product does."""

    router: Any
    gate_up: Any
    down: Any
    mesh: Any = None

    @staticmethod
    def abstract(cfg: ModelConfig) -> Experts:
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        return Experts(router=ArraySpec((e, d), ("router", "embed")),
                       gate_up=ArraySpec((e, f, 2, d), ("experts", "ffn", "gate_up", "embed")),
                       down=ArraySpec((e, d, f), ("experts", "embed", "ffn")))


jax.tree_util.register_dataclass(Experts, data_fields=["router", "gate_up", "down"], meta_fields=["mesh"])


@pytree_dataclass
@dataclass(frozen=True)
class Layer:
    """One decoder block. Projections are stored [out, in] (the Hugging Face layout) and keep heads as axes.

    The projections that read the same input are one weight each, so a step runs one product
    where it would run several (and XLA never joins them anew on every step):
    - `wqkv` [kv_heads, q_per_kv + 2, head_dim, embed]: for each KV head, the query heads that read
      it (query head i is row i % q_per_kv of KV head i // q_per_kv, the Hugging Face numbering),
      then its key, then its value. Grouping by KV head keeps a KV head's query, key and value rows
      on the same device when "kv_heads" is sharded.
    - `w_gate_up` [ffn, 2, embed]: gate and up rows interleaved, so sharding "ffn" keeps each
      channel's pair together.
    `wo` is [embed, q_heads, head_dim]; `bqkv` [kv_heads, q_per_kv + 2, head_dim] or None.
    Norm gains multiply the normalised values as they are: a (1 + w) checkpoint (Gemma) is loaded as 1 + w.
    The switches' weights are None when off: `q_norm`, `k_norm` [head_dim] (qk_norm); `attn_out_norm`,
    `mlp_out_norm` [embed] (sandwich_norm); with experts (num_experts) `experts` replaces w_gate_up and w_down.
    """

    attn_norm: Any
    wqkv: Any
    wo: Any
    bqkv: Any
    mlp_norm: Any
    w_gate_up: Any
    w_down: Any  # [embed, ffn]
    q_norm: Any = None
    k_norm: Any = None
    attn_out_norm: Any = None
    mlp_out_norm: Any = None
    experts: Any = None

    @staticmethod
    def abstract(cfg: ModelConfig) -> Layer:
        d, kv, hd, f = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        group = cfg.num_heads // kv + 2
        dense = not cfg.num_experts
        head_norm = ArraySpec((hd,), ("head_dim",), "ones") if cfg.qk_norm else None
        out_norm = ArraySpec((d,), ("embed",), "ones") if cfg.sandwich_norm else None
        return Layer(
            attn_norm=ArraySpec((d,), ("embed",), "ones"),
            wqkv=ArraySpec((kv, group, hd, d), ("kv_heads", "qkv", "head_dim", "embed")),
            wo=ArraySpec((d, cfg.num_heads, hd), ("embed", "q_heads", "head_dim")),
            bqkv=ArraySpec((kv, group, hd), ("kv_heads", "qkv", "head_dim")) if cfg.attention_bias else None,
            mlp_norm=ArraySpec((d,), ("embed",), "ones"),
            w_gate_up=ArraySpec((f, 2, d), ("ffn", "gate_up", "embed")) if dense else None,
            w_down=ArraySpec((d, f), ("embed", "ffn")) if dense else None,
            q_norm=head_norm, k_norm=head_norm, attn_out_norm=out_norm, mlp_out_norm=out_norm,
            experts=None if dense else Experts.abstract(cfg),
        )

    @staticmethod
    def from_projections(cfg: ModelConfig, *, attn_norm: Any, wq: Any, wk: Any, wv: Any, wo: Any, mlp_norm: Any,
                         w_gate: Any = None, w_up: Any = None, w_down: Any = None, bq: Any = None, bk: Any = None,
                         bv: Any = None, experts: Experts | None = None, **norms: Any) -> Layer:
        """A block from separate projections as checkpoints hold them (numpy): wq [q_heads, head_dim, embed],
        wk and wv [kv_heads, head_dim, embed], w_gate and w_up [ffn, embed], biases without the embed axis;
        `norms` the switches' gains by their Layer names."""
        return Layer(attn_norm=attn_norm, wqkv=fuse_qkv(cfg, wq, wk, wv), wo=wo,
                     bqkv=None if bq is None else fuse_qkv(cfg, bq, bk, bv), mlp_norm=mlp_norm,
                     w_gate_up=None if w_gate is None else np.stack([w_gate, w_up], axis=1), w_down=w_down,
                     experts=experts, **norms)


def fuse_qkv(cfg: ModelConfig, q: Any, k: Any, v: Any) -> np.ndarray:
    """Query [q_heads, ...], key and value [kv_heads, ...] -> [kv_heads, q_per_kv + 2, ...] (see Layer)."""
    kv = cfg.num_kv_heads
    q = np.asarray(q).reshape(kv, cfg.num_heads // kv, *q.shape[1:])
    return np.concatenate([q, np.asarray(k)[:, None], np.asarray(v)[:, None]], axis=1)


def split_qkv(cfg: ModelConfig, qkv: Any) -> tuple[Any, Any, Any]:
    """The inverse of fuse_qkv along axis -2 of activations [..., kv_heads, q_per_kv + 2, head_dim]:
    query [..., q_heads, head_dim], key and value [..., kv_heads, head_dim]."""
    group = cfg.num_heads // cfg.num_kv_heads
    q = qkv[..., :group, :].reshape(*qkv.shape[:-3], cfg.num_heads, qkv.shape[-1])
    return q, qkv[..., group, :], qkv[..., group + 1, :]


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
