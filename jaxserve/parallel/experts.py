"""A mixture of experts on a mesh: each device of `expert` holds its share of the experts (and with tp > 1, each
device of `model` its share of every expert's ffn); the router and the tokens are on every device.

Each device routes every token, runs the tokens routed to its own experts through them (jaxserve.model.moe's grouped
products), and the partial outputs are summed over `expert` and `model`: one all-reduce of [tokens, embed] a layer,
the same cost as a tensor-parallel MLP's, and no all-to-all. The attention is not split over `expert` (its heads
split over `model` alone): at a decode step's few tokens every device of `expert` computing it beats moving them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.model.config import ModelConfig
from jaxserve.model.moe import route, routed_experts
from jaxserve.model.weights import Experts, Layer, Weights
from jaxserve.parallel import sharding


def experts_on_mesh(weights: Weights, mesh: Mesh) -> Weights:
    """The weights with each layer's experts marked as spread over `mesh` (what moe_mlp dispatches on)."""
    if mesh.size == 1:
        return weights

    def layer(w: Layer) -> Layer:
        return w if w.experts is None else dataclasses.replace(w, experts=dataclasses.replace(w.experts, mesh=mesh))

    return dataclasses.replace(weights, layers=tuple(layer(w) for w in weights.layers))


def sharded_moe(x: jax.Array, experts: Experts, cfg: ModelConfig) -> jax.Array:
    """moe_mlp's output for x [tokens, embed] with the experts laid out on experts.mesh -> [tokens, embed] float32."""
    mesh = experts.mesh
    abstract = Experts.abstract(cfg)
    gate_up_spec, down_spec = (sharding.logical_spec(s.axes, s.shape, mesh) for s in (abstract.gate_up, abstract.down))
    split = tuple(a for a in ("expert", "model") if a in (*gate_up_spec, *down_spec))
    experts_split = gate_up_spec[0] == "expert"

    def body(x: Any, router: Any, gate_up: Any, down: Any) -> Any:
        weights, ids = route(x, router, cfg)
        first = jax.lax.axis_index("expert") * gate_up.shape[0] if experts_split else 0
        part = routed_experts(x, weights, ids, gate_up, down, cfg.activation, first)
        return jax.lax.psum(part, split) if split else part

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), gate_up_spec, down_spec), out_specs=P(), check_vma=False)
    return fn(x, experts.router, experts.gate_up, experts.down)
