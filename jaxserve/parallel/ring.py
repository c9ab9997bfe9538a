"""Ring attention over a mesh axis, and the log-sum-exp rule that merges partial attention.

Each of the n devices of the axis keeps its block of queries; the K/V blocks travel round the ring
with `ppermute`, one hop per step, while each device attends to the block it holds. A `Partial`
(unnormalised output, running max, running sum) per query absorbs every block (online softmax), so
no device ever holds more than two K/V blocks.

Causal order is zig-zag: the sequence is cut into 2n chunks and device s holds chunks s and 2n-1-s.
Then at every step after the first, each device does the same work, two chunk-by-chunk products
that need no mask: its late chunk against the visiting early chunk, and either its early chunk
against the visiting early chunk (the visitor comes from an earlier device) or its late chunk against
the visiting late one. Positions still mask every product, which makes padding and ragged lengths
exact; the chunk structure only skips products that the positions would mask entirely.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec


class Partial(NamedTuple):
    """Attention of some queries over a subset of the keys, not yet normalised."""

    o: jax.Array  # [b, t, heads, hd] float32: sum over keys of exp(score - m) * v
    m: jax.Array  # [b, t, heads] float32: the largest score seen (-inf before any key)
    total: jax.Array  # [b, t, heads] float32: sum over keys of exp(score - m)


def empty(b: int, t: int, heads: int, hd: int) -> Partial:
    return Partial(jnp.zeros((b, t, heads, hd), jnp.float32), jnp.full((b, t, heads), -jnp.inf, jnp.float32),
                   jnp.zeros((b, t, heads), jnp.float32))


def _safe(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def merge(a: Partial, b: Partial) -> Partial:
    """The attention over the union of two disjoint key sets (the online-softmax rule)."""
    m = jnp.maximum(a.m, b.m)
    sa, sb = jnp.exp(a.m - _safe(m)), jnp.exp(b.m - _safe(m))
    return Partial(a.o * sa[..., None] + b.o * sb[..., None], m, a.total * sa + b.total * sb)


def merge_across(p: Partial, axis: str) -> Partial:
    """Merges the partials that the devices of `axis` hold for the same queries (each saw other keys)."""
    m = jax.lax.pmax(p.m, axis)
    scale = jnp.exp(p.m - _safe(m))
    return Partial(jax.lax.psum(p.o * scale[..., None], axis), m, jax.lax.psum(p.total * scale, axis))


def scatter_across(p: Partial, axis: str, n: int) -> Partial:
    """Like merge_across for partials of every device's queries ([b, n * t, ...], in device order); each
    device keeps the merged partial of its own t queries."""
    m = jax.lax.pmax(p.m, axis)
    scale = jnp.exp(p.m - _safe(m))
    t = p.m.shape[1] // n
    mine = jax.lax.dynamic_slice_in_dim(m, jax.lax.axis_index(axis) * t, t, axis=1)
    return Partial(jax.lax.psum_scatter(p.o * scale[..., None], axis, scatter_dimension=1, tiled=True), mine,
                   jax.lax.psum_scatter(p.total * scale, axis, scatter_dimension=1, tiled=True))


def finish(p: Partial, dtype: Any) -> jax.Array:
    """The normalised output [b, t, heads, hd]; queries that saw no key get zeros."""
    return (p.o / jnp.where(p.total == 0, 1.0, p.total)[..., None]).astype(dtype)


def block_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float, *,
                    kv_major: bool = False) -> Partial:
    """q [b, tq, heads, hd] over k, v [b, tk, kv_heads, hd] (or [kv_heads, b, tk, hd] with kv_major) where
    visible [b, tq, tk]; grouped-query heads, scores and sums in float32."""
    b, tq, h, hd = q.shape
    kv = k.shape[0] if kv_major else k.shape[2]
    qg = q.reshape(b, tq, kv, h // kv, hd)
    kspec = "kbsd" if kv_major else "bskd"
    s = jnp.einsum(f"bqkgd,{kspec}->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - _safe(m)[..., None])
    o = jnp.einsum(f"bkgqs,{kspec}->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return Partial(o.reshape(b, tq, h, hd), jnp.einsum("bkgq->bqkg", m).reshape(b, tq, h),
                   jnp.einsum("bkgq->bqkg", jnp.sum(p, axis=-1)).reshape(b, tq, h))


def positional_attention(q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array, kv_pos: jax.Array,
                         kv_valid: jax.Array, *, causal: bool, scale: float, diagonal: bool = False,
                         tile: int | None = None) -> Partial:
    """block_attention with the mask made from positions (q_pos [b, tq], kv_pos and kv_valid [b, tk]).

    With `tile`, queries and keys go tile by tile (queries mapped, keys looped with the online rule), so
    memory grows with tile * tile, not tq * tk; `diagonal` (q and k the same chunk, positions rising)
    then skips the tiles above the diagonal, which causality masks entirely."""
    b, tq, h, hd = q.shape
    tk = k.shape[1]

    def mask(qp: jax.Array, kp: jax.Array, kval: jax.Array) -> jax.Array:
        visible = jnp.broadcast_to(kval[:, None, :], (b, qp.shape[1], kp.shape[1]))
        return visible & (kp[:, None, :] <= qp[:, :, None]) if causal else visible

    if tile is None or (tq <= tile and tk <= tile):
        return block_attention(q, k, v, mask(q_pos, kv_pos, kv_valid), scale)
    if tq % tile or tk % tile or (diagonal and tq != tk):
        raise ValueError(f"tiled attention needs {tq=} and {tk=} to be multiples of {tile=} (and equal if diagonal)")

    def one_query_tile(i: jax.Array) -> Partial:
        qt = jax.lax.dynamic_slice_in_dim(q, i * tile, tile, axis=1)
        qp = jax.lax.dynamic_slice_in_dim(q_pos, i * tile, tile, axis=1)

        def key_tile(j: jax.Array, acc: Partial) -> Partial:
            kt, vt, kp, kval = (jax.lax.dynamic_slice_in_dim(x, j * tile, tile, axis=1) for x in (k, v, kv_pos, kv_valid))
            return merge(acc, block_attention(qt, kt, vt, mask(qp, kp, kval), scale))

        return jax.lax.fori_loop(0, i + 1 if diagonal else tk // tile, key_tile, empty(b, tile, h, hd))

    tiles = jax.lax.map(one_query_tile, jnp.arange(tq // tile))  # [tiles, b, tile, ...]
    return Partial(*(jnp.moveaxis(x, 0, 1).reshape(b, tq, *x.shape[3:]) for x in tiles))


def zigzag_order(length: int, n: int) -> np.ndarray:
    """The token order that gives device s chunks s and 2n-1-s of 2n equal chunks; `length` % 2n == 0."""
    if length % (2 * n):
        raise ValueError(f"length={length} must be a multiple of 2 * n={2 * n} for the zig-zag order")
    c = length // (2 * n)
    return np.concatenate([np.r_[s * c:(s + 1) * c, (2 * n - 1 - s) * c:(2 * n - s) * c] for s in range(n)])


Block = tuple[jax.Array, ...]  # (k, v, kv_pos, kv_valid, *extra): arrays [b, tk, ...] that travel together


def ring_attention_shard(
    q: jax.Array,  # [b, tq, heads, hd]: this device's queries (zig-zag chunks s and 2n-1-s when causal)
    q_pos: jax.Array,  # [b, tq] int32
    block: Block,  # this device's K/V: k, v [b, tk, kv_heads, hd], kv_pos [b, tk], kv_valid [b, tk], extras
    *,
    axis: str,
    n: int,
    causal: bool,
    scale: float,
    store: Callable[[Any, Block], Any] | None = None,
    stored: Any = None,
    communicate: bool = True,
    tile: int | None = None,
) -> tuple[Partial, Any]:
    """Ring attention inside shard_map over `axis` (n devices). Query i sees key j where kv_valid[j] and, if
    causal, kv_pos[j] <= q_pos[i]. `store(stored, block)` is called with every block that visits this
    device (its own first) and its result threaded on: the engine writes K/V into its pages there.
    With communicate=False the blocks stay put (same work, no ppermute): for timing the overlap. `tile`: see
    positional_attention (long blocks)."""
    b, tq, h, hd = q.shape
    acc = empty(b, tq, h, hd)
    me = jax.lax.axis_index(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def attend(acc: Partial, at: int | jax.Array, size: int, blk: Block, lo: int, hi: int,
               diagonal: bool = False) -> Partial:
        """Merges queries [at, at + size) against keys [lo, hi) of blk into acc."""
        qs = jax.lax.dynamic_slice_in_dim(q, at, size, axis=1)
        qp = jax.lax.dynamic_slice_in_dim(q_pos, at, size, axis=1)
        k, v, kp, kval = (x[:, lo:hi] for x in blk[:4])
        part = positional_attention(qs, qp, k, v, kp, kval, causal=causal, scale=scale, diagonal=diagonal, tile=tile)
        cur = Partial(*(jax.lax.dynamic_slice_in_dim(x, at, size, axis=1) for x in acc))
        return Partial(*(jax.lax.dynamic_update_slice_in_dim(x, y, at, axis=1) for x, y in zip(acc, merge(cur, part))))

    tk = block[0].shape[1]

    def hop(blk: Block) -> Block:
        return jax.lax.ppermute(blk, axis, ring) if communicate else blk

    nxt = hop(block) if n > 1 else block  # sent before this step's work, so the transfer overlaps it
    if store is not None:
        stored = store(stored, block)
    if causal:  # own chunks: early x early (diagonal), late x early, late x late (diagonal)
        acc = attend(acc, 0, tq // 2, block, 0, tk // 2, diagonal=True)
        acc = attend(acc, tq // 2, tq // 2, block, 0, tk // 2)
        acc = attend(acc, tq // 2, tq // 2, block, tk // 2, tk, diagonal=True)
    else:
        acc = attend(acc, 0, tq, block, 0, tk)

    def visit(i: jax.Array | int, acc: Partial, block: Block, stored: Any) -> tuple[Partial, Any]:
        """Step i >= 1: the block of device (me - i) % n is here."""
        if store is not None:
            stored = store(stored, block)
        if not causal:
            return attend(acc, 0, tq, block, 0, tk), stored
        acc = attend(acc, tq // 2, tq // 2, block, 0, tk // 2)  # late x visiting early: all visible
        earlier = (me - i) % n < me  # the visitor's chunks both precede ours, or both its chunks follow
        k0, k1 = (jax.tree_util.tree_map(lambda x: x[:, :tk // 2], block),
                  jax.tree_util.tree_map(lambda x: x[:, tk // 2:], block))
        picked = jax.tree_util.tree_map(lambda a, c: jnp.where(earlier, a, c), k0, k1)
        return attend(acc, jnp.where(earlier, 0, tq // 2), tq // 2, picked, 0, tk // 2), stored

    def step(i: jax.Array, carry: tuple[Partial, Block, Any]) -> tuple[Partial, Block, Any]:
        acc, block, stored = carry
        nxt = hop(block)
        acc, stored = visit(i, acc, block, stored)
        return acc, nxt, stored

    if n > 1:  # steps 1 .. n-2 pass their block on; the last one keeps it
        acc, block, stored = jax.lax.fori_loop(1, n - 1, step, (acc, nxt, stored))
        acc, stored = visit(n - 1, acc, block, stored)
    return acc, stored


def ring_attention_sharded(mesh: Mesh, *, axis: str = "seq", causal: bool = True, sm_scale: float | None = None,
                           communicate: bool = True, tile: int | None = None) -> Callable[..., jax.Array]:
    """f(q, k, v, pos, valid) -> out, all sharded along tokens (axis 1) over `axis` and laid out in
    zig-zag order when causal: the ring without any reordering, as the engine and the benchmark use it."""
    n = mesh.shape[axis]
    tokens = PartitionSpec(None, axis)

    def body(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, valid: jax.Array) -> jax.Array:
        scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
        acc, _ = ring_attention_shard(q, pos, (k, v, pos, valid), axis=axis, n=n, causal=causal, scale=scale,
                                      communicate=communicate, tile=tile)
        return finish(acc, q.dtype)

    return jax.shard_map(body, mesh=mesh, in_specs=(tokens,) * 5, out_specs=tokens, check_vma=False)


@partial(jax.jit, static_argnames=("mesh", "axis", "causal", "sm_scale"))
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh, axis: str = "seq", causal: bool = True,
                   sm_scale: float | None = None) -> jax.Array:
    """Self-attention of q [b, t, heads, hd] over k, v [b, t, kv_heads, hd] with the sequence spread over
    `axis` of `mesh`; any t (padded inside to a multiple of 2n, or n when not causal). Same result as
    pallas_kernels.flash_attention.reference.flash_attention."""
    n = mesh.shape[axis]
    b, t = q.shape[:2]
    if k.shape[1] != t or v.shape != k.shape:
        raise ValueError(f"ring_attention is self-attention: {q.shape=} {k.shape=} {v.shape=} must share t")
    unit = 2 * n if causal else n
    padded = -(-t // unit) * unit
    order = zigzag_order(padded, n) if causal else np.arange(padded)
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, pad)[:, order] for x in (q, k, v))
    pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, padded))
    out = ring_attention_sharded(mesh, axis=axis, causal=causal, sm_scale=sm_scale)(q, k, v, pos, pos < t)
    return out[:, np.argsort(order)][:, :t]
