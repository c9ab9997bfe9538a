"""The engine's attention on a mesh: `update_and_attend` under shard_map.

Heads are split over `model`: each device writes and reads the pages of its own KV heads, with the
platform's kernels when sp is 1. With sp > 1 the page pool is split over `seq` and every row's pages
are striped (its i-th page lives on device i % sp: jaxserve.engine.pages), so a context longer than
one device's pages is held by all of them:

- decode: each device attends the query to its stripe of the row's pages; the partials merge
  across `seq` by log-sum-exp;
- prefill: the chunk's tokens are spread over `seq` in zig-zag order (the runner reorders them, see
  MeshPlan.reorder); the chunk attends to itself by ring attention, each device storing the visiting
  K/V that belongs to its pages, and to the context before the chunk through the stripes (queries
  gathered, partials merged and scattered back by log-sum-exp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.model.attention import PLAIN, AttentionSpec, update_and_attend, write_pages
from jaxserve.parallel import ring
from jaxserve.parallel.ring import Partial


def write_local(k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array, pages: jax.Array,
                offsets: jax.Array, first_page: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """Writes the tokens of k, v [b, t, kv, hd] whose page (global id, [b, t]) lies in this device's block of
    the pool, which starts at `first_page`; the others are dropped."""
    local = pages - first_page
    local = jnp.where((local >= 0) & (local < k_pages.shape[1]), local, k_pages.shape[1])
    return write_pages(k, v, k_pages, v_pages, local, offsets)


def stripe_partial(q: jax.Array, q_pos: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                   limit: jax.Array, *, shard: jax.Array, n: int, scale: float) -> Partial:
    """q [b, t, heads, hd] at q_pos [b, t] over this device's stripe of each row's pages (the row's pages
    shard, shard + n, ...; global ids in page_table [b, w], the device's block of the pool in k_pages
    [kv, L, page_size, hd]), seeing keys at positions <= q_pos and < limit [b]."""
    b = q.shape[0]
    kv, num_local, size, hd = k_pages.shape
    cols = -(-page_table.shape[1] // n)
    table = jnp.pad(page_table, ((0, 0), (0, cols * n - page_table.shape[1])))
    mine = jnp.take(table.reshape(b, cols, n), shard, axis=2) - shard * num_local  # [b, cols] local ids
    here = (mine >= 0) & (mine < num_local)
    mine = jnp.clip(mine, 0, num_local - 1)
    k = k_pages[:, mine].reshape(kv, b, cols * size, hd)
    v = v_pages[:, mine].reshape(kv, b, cols * size, hd)
    k_pos = ((jnp.arange(cols) * n + shard)[:, None] * size + jnp.arange(size)).reshape(-1)  # [cols * size]
    usable = jnp.repeat(here, size, axis=1) & (k_pos[None] < limit[:, None])  # [b, keys]
    v = jnp.where(usable[None, :, :, None], v, jnp.zeros((), v.dtype))  # stale pages may hold NaN
    visible = usable[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])
    return ring.block_attention(q, k, v, visible, scale, kv_major=True)


@dataclass(frozen=True)
class MeshAttention:
    """An `update_and_attend` for a model sharded over `mesh` (see the module docstring)."""

    mesh: Mesh
    backend: str = "auto"  # the kernels' backend when sp is 1

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 write_at: tuple[jax.Array, jax.Array], page_table: jax.Array, positions: jax.Array,
                 valid: jax.Array, *, spec: AttentionSpec = PLAIN) -> tuple[jax.Array, jax.Array, jax.Array]:
        sp = self.mesh.shape["seq"]
        if sp > 1 and (spec.softcap is not None or spec.window is not None):
            raise ValueError(f"sequence parallelism (sp={sp}) takes no soft-capped or sliding-window attention "
                             f"({spec}); run this model with sp=1")
        tokens = "seq" if sp > 1 and q.shape[1] > 1 else None
        heads, rows, pages = P(None, tokens, "model", None), P(None, tokens), P("model", "seq", None, None)
        body = self._local if sp == 1 else self._decode if q.shape[1] == 1 else self._prefill
        fn = jax.shard_map(partial(body, spec=spec), mesh=self.mesh,
                           in_specs=(heads, heads, heads, pages, pages, (rows, rows), P(), rows, rows),
                           out_specs=(heads, pages, pages), check_vma=False)
        return fn(q, k, v, k_pages, v_pages, write_at, page_table, positions, valid)

    def _local(self, q, k, v, k_pages, v_pages, write_at, page_table, positions, valid, *, spec):  # type: ignore[no-untyped-def]
        return update_and_attend(q, k, v, k_pages, v_pages, write_at, page_table, positions, valid, backend=self.backend,
                                 spec=spec)

    def _decode(self, q, k, v, k_pages, v_pages, write_at, page_table, positions, valid, *, spec):  # type: ignore[no-untyped-def]
        n, shard = self.mesh.shape["seq"], jax.lax.axis_index("seq")
        k_pages, v_pages = write_local(k, v, k_pages, v_pages, *write_at, shard * k_pages.shape[1])
        part = stripe_partial(q, positions, k_pages, v_pages, page_table, positions[:, 0] + 1, shard=shard, n=n,
                              scale=_scale(spec, q))
        return ring.finish(ring.merge_across(part, "seq"), q.dtype), k_pages, v_pages

    def _prefill(self, q, k, v, k_pages, v_pages, write_at, page_table, positions, valid, *, spec):  # type: ignore[no-untyped-def]
        n, shard = self.mesh.shape["seq"], jax.lax.axis_index("seq")
        scale = _scale(spec, q)
        gather = lambda x: jax.lax.all_gather(x, "seq", axis=1, tiled=True)  # noqa: E731
        all_pos, all_valid = gather(positions), gather(valid)
        start = jnp.min(jnp.where(all_valid, all_pos, jnp.iinfo(jnp.int32).max), axis=1)  # [b] the chunk's first
        before = stripe_partial(gather(q), all_pos, k_pages, v_pages, page_table, start, shard=shard, n=n, scale=scale)
        before = ring.scatter_across(before, "seq", n)
        first_page = shard * k_pages.shape[1]

        def store(cache: tuple[jax.Array, jax.Array], block: ring.Block) -> tuple[jax.Array, jax.Array]:
            bk, bv, _, _, pages, offsets = block
            return write_local(bk, bv, *cache, pages, offsets, first_page)

        own, (k_pages, v_pages) = ring.ring_attention_shard(q, positions, (k, v, positions, valid, *write_at),
                                                           axis="seq", n=n, causal=True, scale=scale, store=store,
                                                           stored=(k_pages, v_pages))
        return ring.finish(ring.merge(before, own), q.dtype), k_pages, v_pages


def _scale(spec: AttentionSpec, q: jax.Array) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if spec.sm_scale is None else spec.sm_scale
