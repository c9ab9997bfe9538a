"""int8 weight-only quantization: the `QuantizedArray` type and the model's matmul dispatch points.

A float weight is stored output-major, `[*out, *in]` (wqkv is [kv_heads, q_per_kv + 2, head_dim, embed]), and so is
its quantized form: `values` int8 `[*out, *in]` and `scales` float32 `[groups, *out]`, with
`w[o, i] ≈ values[o, i] * scales[i // group_size, o]` (one group spanning the whole input,
`group_size == 0`, is per-output-channel). Output-major puts each output channel's row of int8
values contiguous in memory, which is what a decode kernel streams (and what its bulk copies of
`[rows, block_k]` tiles want).

The model calls `linear` and `embed_lookup` instead of its own einsums; they take a float weight
or a `QuantizedArray` alike, so quantization is a type, not a fork of the model code.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import QuantConfig
from jaxserve.errors import JaxserveError

GROUPS_AXIS = "quant_groups"  # the logical axis of per-group scales (replicated unless a rule names it)


@dataclass(frozen=True)
class QuantizedArray:
    """int8 values `[*out, *in]` and float32 scales `[groups, *out]` standing for a float `[*out, *in]` weight."""

    values: Any
    scales: Any
    in_ndim: int = 1  # how many trailing axes of `values` are contracted (input axes)
    group_size: int = 0  # input elements per scale; 0: one scale per output channel
    backend: str = "auto"  # the pallas_kernels.quantized_matmul backend its products use

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape, [*out, *in]."""
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(x.size) * x.dtype.itemsize for x in (self.values, self.scales))


jax.tree_util.register_dataclass(QuantizedArray, data_fields=["values", "scales"],
                                 meta_fields=["in_ndim", "group_size", "backend"])


def quantize(w: jax.Array, *, in_ndim: int = 1, group_size: int = 0) -> QuantizedArray:
    """Symmetric int8 quantization of a float weight `[*out, *in]`, one scale per output channel
    (or per `group_size` inputs of it): values = round(w / scale), scale = max|w| / 127."""
    out_shape, in_shape = w.shape[:w.ndim - in_ndim], w.shape[w.ndim - in_ndim:]
    k, n = math.prod(in_shape), math.prod(out_shape)
    gs = group_size or k
    if k % gs:
        raise JaxserveError(f"quantization group_size={group_size} does not divide the weight's input size {k} "
                            f"(shape {tuple(w.shape)}); pick a divisor or 0 for per-channel scales")
    w2 = jnp.asarray(w, jnp.float32).reshape(n, k // gs, gs)
    amax = jnp.max(jnp.abs(w2), axis=2)  # [n, groups]
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w2 / scales[:, :, None]), -127, 127).astype(jnp.int8).reshape(w.shape)
    return QuantizedArray(values, scales.T.reshape(k // gs, *out_shape), in_ndim=in_ndim, group_size=group_size)


def dequantize(q: QuantizedArray, dtype: Any = jnp.float32) -> jax.Array:
    """The float weight `[*out, *in]` that `q` stands for."""
    out_shape = q.values.shape[: q.values.ndim - q.in_ndim]
    in_shape = q.values.shape[q.values.ndim - q.in_ndim:]
    k, n = math.prod(in_shape), math.prod(out_shape)
    groups = q.scales.shape[0]
    v = q.values.reshape(n, groups, k // groups).astype(jnp.float32)
    w = v * q.scales.reshape(groups, n).T[:, :, None]
    return w.reshape(*out_shape, *in_shape).astype(dtype)


def linear(x: jax.Array, w: Any, *, in_ndim: int = 1, preferred_element_type: Any = None) -> jax.Array:
    """x [..., *in] times a weight [*out, *in] (float, or a QuantizedArray) -> [..., *out].

    One 2-D product whatever the weight's axes. A float weight's `in_ndim` is given here; a
    QuantizedArray carries its own. On CPU, a product over few tokens puts the weight on the left
    (w @ x.T): XLA's CPU matmul is then about 1.5-2x cheaper for 8-32 tokens.
    """
    if isinstance(w, QuantizedArray):
        from pallas_kernels.quantized_matmul import quantized_matmul

        in_ndim = w.in_ndim
        out_shape = w.values.shape[: w.values.ndim - in_ndim]
        k, n = math.prod(x.shape[x.ndim - in_ndim:]), math.prod(out_shape)
        y = quantized_matmul(x.reshape(-1, k), w.values.reshape(n, k), w.scales.reshape(-1, n),
                             out_dtype=preferred_element_type or x.dtype, backend=w.backend)
    else:
        out_shape = w.shape[: w.ndim - in_ndim]
        k = math.prod(w.shape[w.ndim - in_ndim:])
        x2, w2 = x.reshape(-1, k), w.reshape(-1, k)
        if x2.shape[0] <= 64 and jax.default_backend() == "cpu":
            y = jnp.dot(w2, x2.T, preferred_element_type=preferred_element_type).T
        else:
            y = jax.lax.dot_general(x2, w2, (((1,), (1,)), ((), ())), preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[: x.ndim - in_ndim], *out_shape)


def with_backend(weights: Any, backend: str) -> Any:
    """The same weights, their quantized arrays multiplied through another pallas_kernels.quantized_matmul backend."""
    return jax.tree_util.tree_map(lambda w: dataclasses.replace(w, backend=backend) if isinstance(w, QuantizedArray)
                                  else w, weights, is_leaf=lambda w: isinstance(w, QuantizedArray))


def row_multiple(weights: Any) -> int:
    """The row count that the quantized products of `weights` pad their activations to a multiple of (1 for float
    weights or an XLA backend); see pallas_kernels.quantized_matmul.row_multiple."""
    from pallas_kernels.quantized_matmul import row_multiple as kernel_row_multiple

    leaves = jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return max((kernel_row_multiple(w.backend) for w in leaves if isinstance(w, QuantizedArray)), default=1)


def embed_lookup(table: Any, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Rows of the embedding table [vocab, embed] (float, or a QuantizedArray with vocab as its output axis)."""
    if isinstance(table, QuantizedArray):
        if table.group_size:
            raise ValueError(f"a quantized embedding has one scale per row, not groups of {table.group_size}")
        rows = jnp.take(table.values, tokens, axis=0).astype(jnp.float32)
        return (rows * jnp.take(table.scales[0], tokens, axis=0)[..., None]).astype(dtype)
    return jnp.take(table, tokens, axis=0)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


# name -> input axes. A mixture's experts (Layer.experts) stay float: their grouped products take no int8 weights.
_LINEAR = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}


def quantize_weights(weights: Any, qcfg: QuantConfig, dtype: Any = None) -> Any:
    """The `Weights` tree with its linear layers (and by `qcfg` its head and embedding) quantized.

    Leaves are quantized one at a time from whatever they are (numpy or device arrays, best in
    float32), so only one float weight is on the device at once; the rest are cast to `dtype`.
    """
    from jaxserve.model.weights import Layer, Weights

    dtype = dtype or jnp.float32

    def q(w: Any, in_ndim: int, group_size: int) -> QuantizedArray:
        return jax.block_until_ready(quantize(jnp.asarray(w), in_ndim=in_ndim, group_size=group_size))

    def f(w: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), w)

    def layer(lw: Layer) -> Layer:
        fields = {name: (q(getattr(lw, name), _LINEAR[name], qcfg.group_size)
                         if name in _LINEAR and getattr(lw, name) is not None else f(getattr(lw, name)))
                  for name in (fl.name for fl in dataclasses.fields(lw))}
        return Layer(**fields)

    tied = weights.lm_head is None
    # The embedding is gathered by rows, so it takes per-row (per-channel) scales only.
    embed = q(weights.embed, 1, 0) if (qcfg.embed or (tied and qcfg.head)) else f(weights.embed)
    head = f(weights.lm_head) if (tied or not qcfg.head) else q(weights.lm_head, 1, qcfg.group_size)
    return Weights(embed=embed, layers=tuple(layer(lw) for lw in weights.layers), final_norm=f(weights.final_norm),
                   lm_head=head)


def quantized_spec(spec: Any, in_ndim: int, group_size: int) -> QuantizedArray:
    """The QuantizedArray of ArraySpecs that quantizes a float weight's ArraySpec (see quantized_abstract)."""
    from jaxserve.model.weights import ArraySpec

    n_out = len(spec.shape) - in_ndim
    in_shape, out_shape, out_axes = spec.shape[n_out:], spec.shape[:n_out], spec.axes[:n_out]
    groups = math.prod(in_shape) // group_size if group_size else 1
    return QuantizedArray(ArraySpec(spec.shape, spec.axes),
                          ArraySpec((groups, *out_shape), (GROUPS_AXIS, *out_axes), "ones"),
                          in_ndim=in_ndim, group_size=group_size)


def quantized_abstract(specs: Any, qcfg: QuantConfig) -> Any:
    """`Weights.abstract(cfg)` with the quantized leaves' specs as QuantizedArrays of ArraySpecs.

    The values keep the float weight's logical axes, output axes first (so a rule that shards
    "ffn" shards the values along ffn); per-channel scales carry the output axes, per-group scales
    also a leading GROUPS_AXIS.
    """
    from jaxserve.model.weights import Layer, Weights

    q = quantized_spec

    def layer(ls: Layer) -> Layer:
        return dataclasses.replace(ls, **{name: q(getattr(ls, name), n, qcfg.group_size) for name, n in _LINEAR.items()
                                          if getattr(ls, name) is not None})

    tied = specs.lm_head is None
    embed = q(specs.embed, 1, 0) if (qcfg.embed or (tied and qcfg.head)) else specs.embed
    head = specs.lm_head if (tied or not qcfg.head) else q(specs.lm_head, 1, qcfg.group_size)
    return Weights(embed=embed, layers=tuple(layer(ls) for ls in specs.layers), final_norm=specs.final_norm, lm_head=head)


def decode_weight_bytes(weights: Any, experts_per_token: int = 0, rows: int = 1) -> int:
    """Bytes of weights a decode step of `rows` tokens reads: every weight but the embedding table (a row a token,
    unless the head is tied to it) and, of each mixture of experts, those the tokens are routed to: `rows *
    experts_per_token` experts at most (exactly that at one row: the batch-1 bandwidth floor)."""
    total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(weights, is_leaf=is_quantized))
    embed = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(weights.embed, is_leaf=is_quantized))
    if weights.lm_head is not None:
        total -= embed - rows * embed // weights.embed.shape[0]
    for lw in weights.layers:
        if lw.experts is not None:
            n = lw.experts.gate_up.shape[0]
            expert_bytes = int(lw.experts.gate_up.nbytes + lw.experts.down.nbytes)
            total -= expert_bytes - expert_bytes * min(rows * experts_per_token, n) // n
    return total


def linear_bytes(weights: Any) -> int:
    """Bytes of the decoder layers' linear weights (values and scales when quantized)."""
    total = 0
    for lw in weights.layers:
        linears = [getattr(lw, name) for name in _LINEAR if getattr(lw, name) is not None]
        experts = [] if lw.experts is None else [lw.experts.gate_up, lw.experts.down]
        for w in linears + experts:
            total += w.nbytes if isinstance(w, QuantizedArray) else int(w.size) * w.dtype.itemsize
    return total
