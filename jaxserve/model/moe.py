"""The mixture-of-experts MLP (ModelConfig.num_experts): top-k routing, then each expert's gated MLP over the tokens
routed to it, grouped by expert with `jax.lax.ragged_dot` (one product per projection for all experts, no padding
to a capacity, no token dropped).

Routing is the models' own: a softmax over every expert's router logit, the `experts_per_token` largest kept and,
with `norm_topk_prob`, renormalised to sum to 1 (for Mixtral this is the softmax over the top-k logits). Experts
spread over devices (`Experts.mesh`) run through jaxserve.parallel.experts, which calls `routed_experts` on each
device's share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.model.quant import linear
from jaxserve.model.weights import Experts

# lhs [rows, embed] by rhs [experts, *out, embed] -> [rows, *out], rows grouped by expert in order
_BY_EXPERT = {ndim: jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [ndim - 1]), ([], [])),
                                                      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
              for ndim in (3, 4)}


def glu(gate_up: jax.Array, activation: str) -> jax.Array:
    """The gated unit of [..., ffn, 2] (gate, up) pairs: act(gate) * up, act silu (SwiGLU) or gelu_tanh (GeGLU)."""
    gate = gate_up[..., 0]
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return act * gate_up[..., 1]


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [tokens, embed] -> (weights [tokens, k] float32, expert ids [tokens, k] int32) of each token's k experts."""
    probs = jax.nn.softmax(linear(x, router, preferred_element_type=jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, ids.astype(jnp.int32)


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array, down: jax.Array,
                   activation: str, first: jax.Array | int = 0) -> jax.Array:
    """The weighted sum over each token's routed experts that lie in [first, first + local experts): x [tokens,
    embed], weights and ids [tokens, k], gate_up [local experts, ffn, 2, embed], down [local experts, embed, ffn]
    -> [tokens, embed] float32. A device holding some of the experts (or some of each one's ffn) gives its part."""
    tokens, k = ids.shape
    local = gate_up.shape[0]
    mine = (ids >= first) & (ids < first + local)
    group = jnp.where(mine, ids - first, local).reshape(-1)  # other devices' experts sort last and form no group
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=local + 1)[:local].astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # [tokens * k, embed], grouped by expert
    h = jax.lax.ragged_dot_general(rows, gate_up, sizes, _BY_EXPERT[4], preferred_element_type=jnp.float32)
    h = glu(h.astype(x.dtype), activation)  # [tokens * k, ffn]
    out = jax.lax.ragged_dot_general(h, down, sizes, _BY_EXPERT[3], preferred_element_type=jnp.float32)
    scale = jnp.where(mine, weights, 0.0).reshape(-1)[order]  # rows past the groups are zero, and so weighted
    return jnp.zeros((tokens, x.shape[1]), jnp.float32).at[order // k].add(out * scale[:, None])


def moe_mlp(x: jax.Array, experts: Experts, cfg: ModelConfig) -> jax.Array:
    """The mixture's output for x [..., embed] (already normed) -> [..., embed] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if experts.mesh is not None:
        from jaxserve.parallel.experts import sharded_moe

        out = sharded_moe(flat, experts, cfg)
    else:
        weights, ids = route(flat, experts.router, cfg)
        out = routed_experts(flat, weights, ids, experts.gate_up, experts.down, cfg.activation)
    return out.astype(x.dtype).reshape(x.shape)
