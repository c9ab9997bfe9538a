"""The decode megakernel's math in jnp: every decoder layer of a decode step, over weights and K/V pages stacked
across the layers, as one kernel on the chip is to compute it.

Stacked, so that a kernel looping over the layers on the chip reads every layer through one ref:
- each int8 product [layers · n, k] (per-channel scales [layers · n]), a layer's rows in the order the kernel's
  phases read them: qkv by KV head (its query heads, its key, its value: the served `wqkv` order), and gate_up in
  blocks of 128 channels, their gate rows then their up rows (a 128-row tile of sums is then all gate or all up,
  and the down phase's converter reads a channel's gate and up 128 columns apart); held as the kernel's tiles,
  [layers · n / 128 · k / 256, 128, 256] (a layer's row tiles, each's input steps, in order), so that each of the
  kernel's weight copies reads 32 KB of contiguous bytes (`tiles=False`: [layers · n, k], row-major);
- the norms' gains [layers, 2, d] (attention's, the MLP's);
- K and V pages [layers · kv_heads · pool · page_size, head_dim], a (layer, KV head)'s pool contiguous.

A step's math, a layer at a time, with r the 1/rms of the product's input row (applied to the product's output,
as jaxserve.model.transformer.normed_linear does): qkv = ((x · g_attn) @ Wᵀ) · s · r; q and k rotated at the
row's position (its length: the positions already cached); k and v rounded to the pages' dtype and written at that
position; attention over the cached positions and the new one; h1 = x + (o @ Woᵀ) · s; gate_up as qkv from h1 with
the MLP's gain; h2 = h1 + (SiLU(gate) · up @ Wdownᵀ) · s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.reference import paged_attention_reference

BLOCK = 128  # gate_up's channels a block (the kernel's tile of output rows)
TILE = (BLOCK, 256)  # a weight tile: the kernel's output rows and inputs a step
PRODUCTS = ("wqkv", "wo", "w_gate_up", "w_down")


class StackedLayers(NamedTuple):
    """A model's decoder layers, stacked (see the module docstring)."""

    values: tuple  # int8 [layers · n / TILE[0] · k / TILE[1], *TILE] (or [layers · n, k]) for each of PRODUCTS
    scales: tuple  # float32 [layers · n] for each of PRODUCTS
    gains: jax.Array  # float32 [layers, 2, d]


def _blocked_gate_up(a: jax.Array) -> jax.Array:
    """[ffn, 2, ...] (gate and up interleaved a channel at a time, the served order) -> [2 · ffn, ...] in blocks of
    BLOCK channels: the block's gate rows, then its up rows."""
    ffn = a.shape[0]
    return a.reshape(ffn // BLOCK, BLOCK, 2, *a.shape[2:]).swapaxes(1, 2).reshape(2 * ffn, *a.shape[2:])


def to_tiles(w: jax.Array) -> jax.Array:
    """[n, k] -> [n / TILE[0] · k / TILE[1], *TILE]: row tiles in order, each's input steps in order."""
    (n, k), (bn, bk) = w.shape, TILE
    return w.reshape(n // bn, bn, k // bk, bk).swapaxes(1, 2).reshape(-1, bn, bk)


def from_tiles(w: jax.Array, n: int) -> jax.Array:
    """to_tiles' inverse for n rows."""
    bn, bk = TILE
    return w.reshape(n // bn, -1, bn, bk).swapaxes(1, 2).reshape(n, -1)


def stack_layers(cfg: Any, layers: Sequence[Any], tiles: bool = True) -> StackedLayers:
    """The layers of int8 weights (jaxserve.model.quant.QuantizedArray, one scale a channel) stacked, where the
    weights are (on their device), as the kernel's tiles (`tiles=False`: row-major). Raises ValueError naming what
    the megakernel does not take: float or grouped weights, biases, an ffn not in blocks of BLOCK channels, a
    product not of whole tiles."""
    if cfg.intermediate_size % BLOCK:
        raise ValueError(f"the megakernel takes gate_up in blocks of {BLOCK} channels: intermediate_size="
                         f"{cfg.intermediate_size} is not a multiple of {BLOCK}")
    values: dict[str, list[Any]] = {name: [] for name in PRODUCTS}
    scales: dict[str, list[Any]] = {name: [] for name in PRODUCTS}
    gains = []
    for i, layer in enumerate(layers):
        if layer.bqkv is not None:
            raise ValueError(f"layer {i} has a qkv bias; the megakernel takes none")
        for name in PRODUCTS:
            w = getattr(layer, name)
            if not hasattr(w, "values") or w.group_size != 0:
                raise ValueError(f"layer {i}'s {name} must be int8 with one scale a channel (QuantizedArray, "
                                 f"group_size 0), got {type(w).__name__}"
                                 + (f" with group_size {w.group_size}" if hasattr(w, "group_size") else ""))
            v, s = w.values, w.scales[0]  # [*out, *in], [*out]
            if name == "w_gate_up":
                v, s = _blocked_gate_up(v), _blocked_gate_up(s)
            k = int(np.prod(v.shape[v.ndim - w.in_ndim:]))
            v = v.reshape(-1, k)
            if tiles and (v.shape[0] % TILE[0] or k % TILE[1]):
                raise ValueError(f"the megakernel's weight tiles are {list(TILE)}: layer {i}'s {name} is "
                                 f"{list(v.shape)}")
            values[name].append(to_tiles(v) if tiles else v)
            scales[name].append(s.reshape(-1).astype(jnp.float32))
        gains.append(jnp.stack([jnp.asarray(layer.attn_norm, jnp.float32), jnp.asarray(layer.mlp_norm, jnp.float32)]))
    return StackedLayers(tuple(jnp.concatenate(values[n]) for n in PRODUCTS),
                         tuple(jnp.concatenate(scales[n]) for n in PRODUCTS), jnp.stack(gains))


def stack_pages(pages: Sequence[jax.Array]) -> jax.Array:
    """Per-layer pools [kv_heads, pool, page_size, head_dim] (jaxserve.model.kv_cache.KVCache's) -> the stacked
    [layers · kv_heads · pool · page_size, head_dim]."""
    return jnp.stack(pages).reshape(-1, pages[0].shape[-1])


def _rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [rows, heads, head_dim] rotated by each row's position (half-split: jaxserve.model.transformer.apply_rope's
    math, which pallas_kernels does not import)."""
    angles = positions[:, None].astype(jnp.float32) * inv_freq  # [rows, hd / 2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def decode_layers(cfg: Any, st: StackedLayers, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                  page_table: jax.Array, lengths: jax.Array, inv_freq: np.ndarray, page_size: int,
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every layer of a decode step: x [rows, d] (the new tokens, embedded), pages stacked (stack_pages) of
    page_size positions, page_table [rows, pages] int32, lengths [rows] int32 (positions cached; the new token's is
    next; its page must be in the table), inv_freq the rotary frequencies [head_dim / 2] ->
    (h [rows, d] float32, the layers' output before the final norm; k_pages; v_pages with the new K/V written)."""
    layers = st.gains.shape[0]
    kvh, hd, group = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    pool = k_pages.shape[0] // (layers * kvh * page_size)  # pages of a (layer, KV head)
    shape5 = (layers, kvh, pool, page_size, hd)  # a layer's [kv_heads, pool, page, hd]: the engine's pool's layout
    rows = x.shape[0]
    eps = cfg.rms_norm_eps
    sizes = {name: s.shape[0] // layers for name, s in zip(PRODUCTS, st.scales)}

    def product(name, layer, a, gain=None):
        values, scales = st.values[PRODUCTS.index(name)], st.scales[PRODUCTS.index(name)]
        n = sizes[name]
        per_layer = values.shape[0] // layers  # rows, or tiles
        w = jax.lax.dynamic_slice_in_dim(values, layer * per_layer, per_layer)
        w = (from_tiles(w, n) if w.ndim == 3 else w).astype(jnp.float32)
        s = jax.lax.dynamic_slice_in_dim(scales, layer * n, n)
        y = (a if gain is None else a * gain) @ w.T * s
        if gain is not None:  # a normed product: its input row's 1/rms on the output
            y = y * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + eps)
        return y

    page_of = jnp.take_along_axis(page_table, (lengths // page_size)[:, None], axis=1)[:, 0]
    heads = jnp.arange(kvh)[None, :]

    def layer_step(layer, carry):
        x, k_pages, v_pages = carry  # [layers, kv_heads, pool, page, hd]
        gains = st.gains[layer]
        qkv = product("wqkv", layer, x, gains[0]).reshape(rows, kvh, group + 2, hd)
        q = _rope(qkv[:, :, :group].reshape(rows, kvh * group, hd), lengths, inv_freq)
        k = _rope(qkv[:, :, group], lengths, inv_freq)  # [rows, kvh, hd]
        at = (layer, heads, page_of[:, None], (lengths % page_size)[:, None])  # the new token's position
        k_pages = k_pages.at[at].set(k.astype(k_pages.dtype))
        v_pages = v_pages.at[at].set(qkv[:, :, group + 1].astype(v_pages.dtype))
        o = paged_attention_reference(q.astype(k_pages.dtype)[:, None], k_pages[layer], v_pages[layer], page_table,
                                      lengths[:, None])  # the cached positions and the new one
        h1 = x + product("wo", layer, o.reshape(rows, -1).astype(jnp.float32))
        gu = product("w_gate_up", layer, h1, gains[1]).reshape(rows, -1, 2, BLOCK)
        h2 = h1 + product("w_down", layer, (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(rows, -1))
        return h2, k_pages, v_pages

    h, k_pages, v_pages = jax.lax.fori_loop(0, layers, layer_step,
                                            (x.astype(jnp.float32), k_pages.reshape(shape5), v_pages.reshape(shape5)))
    return h, k_pages.reshape(-1, hd), v_pages.reshape(-1, hd)

