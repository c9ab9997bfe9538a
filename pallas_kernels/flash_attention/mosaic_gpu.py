"""Flash attention for Hopper in Pallas Mosaic GPU: TMA copies, wgmma, a producer warpgroup.

One program owns 128 query rows of one KV head's group: `heads_per_program` query heads times
`128 // heads_per_program` positions, so each K/V block it loads serves the whole group. Two
compute warpgroups take 64 rows each (the wgmma M); a third warpgroup only issues the TMA copies
of K and V into a ring of `stages` shared-memory buffers. The softmax is online, in base 2, in
float32, and overlaps the tensor cores: each step issues the next block's q·kᵀ with this block's
p·v, and computes the next block's softmax while p·v runs. K/V come either from dense arrays or
straight from KV pages through the page table.
In the block that crosses a row's length, V's rows past it are zeroed in shared memory before
P·V, so stale page contents (even NaN) never reach the output.
With a sliding window a program starts at the first block any of its queries sees (the blocks wholly
behind the window are neither copied nor computed), and masks the blocks the window's edge crosses;
a soft-cap squashes the scores (cap · tanh(s · scale / cap)) before any mask.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.reference import window_blocks

ROWS = 64  # query rows per compute warpgroup: the wgmma M
COMPUTE_WGS = 2
_LOG2E = math.log2(math.e)
_NEG = -1e30  # a finite -inf, so fully masked rows never compute inf - inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic GPU flash kernel."""

    block_k: int = 128  # keys per step (the wgmma N of Q·Kᵀ, the K of P·V)
    stages: int = 2  # K/V buffers in the ring (2: ahead of 3 at 7 of 8 H100 points with the overlapped loop)
    heads_per_program: int = 1  # query heads of one group per program; 128 // this = query positions
    interleave: int | None = None  # (row, KV head, head group) units whose programs start interleaved (>= 1);
    # None: dense causal calls choose by program_order, others take 1

    @property
    def block_q(self) -> int:
        return COMPUTE_WGS * ROWS // self.heads_per_program


def mma_transforms(dtype: Any) -> tuple[Any, ...]:
    swizzle = 128
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def mosaic_dtype(dtype: Any) -> Any:
    """The tensor-core operand type: float32 inputs are rounded to bfloat16 (wgmma cannot transpose 32-bit K)."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)


def reads_float8_pages(head_dim: int) -> bool:
    """8-bit pages go through the ring in 128-byte swizzled rows: head_dim must fill them."""
    return head_dim % 128 == 0


def operand_dtypes(q_dtype: Any, k_dtype: Any, v_dtype: Any, head_dim: int) -> tuple[Any, Any]:
    """(tensor-core dtype, K/V ring dtype). float8_e4m3fn pages stay 8-bit in the ring and are converted to
    float16 in shared memory (float8 -> bfloat16 needs a newer PTX ISA); others are rounded like q."""
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    staged = jnp.dtype(k_dtype) == fp8
    if staged != (jnp.dtype(v_dtype) == fp8):
        raise ValueError(f"k ({k_dtype}) and v ({v_dtype}) must both be float8_e4m3fn or neither")
    if not staged:
        return mosaic_dtype(q_dtype), mosaic_dtype(q_dtype)
    if not reads_float8_pages(head_dim):
        raise ValueError(f"float8_e4m3fn pages need head_dim a multiple of 128 on Mosaic GPU (a 128-byte swizzled "
                         f"row), got head_dim={head_dim}; use backend='reference' for this model")
    return jnp.dtype(jnp.float16), fp8


def with_layout(x: jax.Array, layout: Any, *, interpreted: bool) -> jax.Array:
    """plgpu.layout_cast, which the interpreter does not know (it needs no layouts)."""
    return x if interpreted else plgpu.layout_cast(x, layout)


def mma_transposed(a_ref: Any, b_ref: Any, *, interpreted: bool) -> jax.Array:
    """a_ref @ b_refᵀ in float32 by wgmma (the interpreter lacks transposed operands: it loads them)."""
    if interpreted:
        return lax.dot_general(a_ref[...], b_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def product(ref):
        plgpu.wgmma(ref, a_ref, b_ref.transpose((1, 0)))
        return ref[...]

    return pl.run_scoped(product, plgpu.ACC((a_ref.shape[0], b_ref.shape[0]), jnp.float32))


def mma_accumulate(acc: jax.Array, a: jax.Array, b_ref: Any, *, interpreted: bool) -> jax.Array:
    """acc + a @ b_ref, with wgmma accumulating in place (the interpreter lacks register operands: it loads b)."""
    if interpreted:
        return acc + jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)

    def accumulate(ref):
        plgpu.wgmma(ref, a, b_ref)

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def mma_overlapped(q_ref: Any, k_ref: Any, acc: jax.Array, p: jax.Array, v_ref: Any, then: Any, init: tuple,
                   zeros: jax.Array, *, interpreted: bool) -> tuple[tuple, jax.Array]:
    """(then(q_ref @ k_refᵀ), acc + p @ v_ref), with `then` running while p·v is on the tensor cores.

    Both products are issued at once; the scores are awaited alone (one wgmma group may stay in
    flight), and `then` returns values shaped like `init`. p·v is awaited at the end.
    """
    if interpreted:
        s = lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return then(s), acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

    def body(refs):
        s_ref, o_ref, *out_refs = refs
        plgpu.wgmma(s_ref, q_ref, k_ref.transpose((1, 0)))
        plgpu.wgmma(o_ref, p, v_ref)
        for ref, value in zip(out_refs, then(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))):
            ref[...] = value

    _, acc, *out = pl.run_state(body)((plgpu.ACC.init(zeros), plgpu.ACC.init(acc), *init))
    return tuple(out), acc


def online_softmax(s: jax.Array, m: jax.Array, denom: jax.Array, c: float, axis: int = 1):
    """One block of the online softmax in base 2: raw scores s (masked keys -inf), keys along `axis` of the 2-D
    s, m = running max of s·c.

    Returns (p, m, denom, alpha): alpha rescales what was accumulated under the old m. The max is
    taken of the raw scores, so p = 2^(s·c - m) is one fused multiply-add per score.
    """
    if c <= 0:  # a non-positive scale reverses the max: scale first, keeping masked keys at -inf
        s, c = jnp.where(s == -jnp.inf, s, s * c), 1.0
    m_new = jnp.maximum(m, jnp.max(s, axis=axis) * c)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [1 - axis]))
    return p, m_new, denom * alpha + jnp.sum(p, axis=axis), alpha


def converted(tile: Any, stage: Any, free: Any, *, interpreted: bool, rows: int | None = None) -> Any:
    """An 8-bit tile of the K/V ring as a tensor-core operand: converted into `stage` (float16, tiled and
    swizzled like a 16-bit ring tile), `rows` at a time (all by default), with the ring slot handed back
    at once through `free`."""
    rows = rows or tile.shape[0]
    assert tile.shape[0] % rows == 0, (tile.shape, rows)
    for r in range(0, tile.shape[0], rows):
        x = tile.at[pl.ds(r, rows)][...]
        if not interpreted:  # 32-bit shared-memory reads of 4 values each, then one shuffle to the wgmma layout
            x = plgpu.layout_cast(x, plgpu.Layout.WGMMA_UPCAST_2X)
        stage.at[pl.ds(r, rows)][...] = with_layout(x.astype(stage.dtype), plgpu.Layout.WGMMA, interpreted=interpreted)
    plgpu.commit_smem()
    plgpu.barrier_arrive(free)
    return stage


def zero_rows_from(tile_ref: Any, first: jax.Array, *, interpreted: bool, below: Any = None) -> None:
    """Zeroes rows `first`.. of a [block_k, hd] SMEM tile of V (and with `below`, the rows before it) and makes the
    writes visible to wgmma.

    Those rows hold keys at or past the row's length (or behind every query's sliding window): stale page
    contents, maybe NaN, which a zero probability would not cancel (0 × NaN is NaN). Only the block that
    crosses the length (or the window's edge) needs it.
    """
    rows, hd = tile_ref.shape
    for r in range(0, rows, ROWS):
        part = tile_ref.at[pl.ds(r, ROWS)]
        row = r + with_layout(lax.broadcasted_iota(jnp.int32, (ROWS, hd), 0), plgpu.Layout.WGMMA,
                              interpreted=interpreted)
        keep = row < first if below is None else (row < first) & (row >= below)
        part[...] = jnp.where(keep, part[...], jnp.zeros((), part.dtype))
    plgpu.commit_smem()


def softcapped(s, softcap: float | None, scale: float):
    """(scores, factor of the base-2 softmax): raw scores and scale·log2(e), or softcap·tanh(s·scale/softcap) and
    log2(e)."""
    if softcap is None:
        return s, scale * _LOG2E
    return softcap * jnp.tanh(s * (scale / softcap)), _LOG2E


def _kernel(q_ref, k_ref, v_ref, table_ref, q_start_ref, kv_len_ref, o_ref, q_smem, k_smem, v_smem, *refs,
            paged: bool, causal: bool, scale: float, softcap: float | None, window: int | None, group: int,
            bs: BlockSizes, num_qt: int, kv_heads: int, interleave: int, staged: bool, interpreted: bool):
    # q_ref: [b, q_len, heads, hd]; k_ref, v_ref: [b, kv_len, kv_heads, hd] or [kv_heads, pages, ps, hd]
    # table_ref: [b, pages_per_row]; q_start_ref, kv_len_ref: [b]; o_ref like q_ref
    # With 8-bit pages (`staged`) each compute warpgroup converts the ring's tiles into its own k_stage and
    # v_stage, the tensor-core operands, and hands each ring slot back as soon as it is converted.
    k_stage, v_stage, *refs = refs if staged else (None, None, *refs)
    q_bar, k_bar, v_bar, k_free, v_free = refs
    bk, stages, block_q, hpp = bs.block_k, bs.stages, bs.block_q, bs.heads_per_program
    # A unit is one (row, KV head, query-head group): its programs read the same K/V. See `program_order`.
    unit = lax.axis_index("units") * interleave + (lax.axis_index("interleaved") if interleave > 1 else 0)
    head_groups = group // bs.heads_per_program
    b, kvh, hg = unit // (kv_heads * head_groups), unit // head_groups % kv_heads, unit % head_groups
    qt = num_qt - 1 - lax.axis_index("qt")  # the longest causal rows first
    wg = lax.axis_index("wg")
    q0 = qt * block_q
    q_start = q_start_ref[b]
    kv_len = kv_len_ref[b]
    hi = jnp.minimum(kv_len, q_start + q0 + block_q) if causal else kv_len
    num_blocks = jnp.maximum(hi + bk - 1, 0) // bk
    lo = jnp.minimum(kv_len, q_start + q0 + 1) if causal else kv_len
    num_full = jnp.clip(lo // bk, 0, num_blocks)
    n = jnp.maximum(num_blocks, 1)  # a row with no keys still runs one block, all masked, so the loop has a start
    # blocks j0 .. n - 1 run (ring position j - j0); those below lo_full cross the window's lower edge
    j0, lo_full = window_blocks(q_start + q0, q_start + q0 + block_q - 1, window, bk, n)
    behind = 0 if window is None else q_start + q0 - window + 1  # keys before it are behind every query's window

    seg = min(ROWS, block_q)  # rows of one (head, positions) run inside a warpgroup's 64

    def segments(w):
        for s in range(ROWS // seg):
            row = w * ROWS + s * seg
            head = kvh * group + hg * hpp + row // block_q
            yield s, head, q0 + row % block_q

    def fetch(src, dst, barrier, j):
        if not paged:
            plgpu.copy_gmem_to_smem(src.at[b, pl.ds(j * bk, bk), kvh], dst, barrier)
            return
        ps = src.shape[2]
        last_entry, last_page = table_ref.shape[1] - 1, src.shape[1] - 1
        if ps >= bk:
            page = table_ref[b, jnp.minimum(j * bk // ps, last_entry)]
            page = jnp.clip(page, 0, last_page)
            plgpu.copy_gmem_to_smem(src.at[kvh, page, pl.ds(j * bk % ps, bk)], dst, barrier)
        else:
            for i in range(bk // ps):
                page = jnp.clip(table_ref[b, jnp.minimum(j * (bk // ps) + i, last_entry)], 0, last_page)
                plgpu.copy_gmem_to_smem(src.at[kvh, page], dst.at[pl.ds(i * ps, ps)], barrier)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def step(j, carry):
            slot = lax.rem(j - j0, stages)

            @pl.when(j - j0 >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            fetch(k_ref, k_smem.at[slot], k_bar.at[slot], j)

            @pl.when(j - j0 >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            fetch(v_ref, v_smem.at[slot], v_bar.at[slot], j)
            return carry

        lax.fori_loop(j0, n, step, None)

        def drain(j, carry):  # every completion of a barrier is awaited before the kernel ends
            slot = lax.rem(j - j0, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            return carry

        lax.fori_loop(jnp.maximum(n - stages, j0), n, drain, None)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_tile = q_smem.at[wg]
        for s, head, pos in segments(wg):
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(pos, seg), head], q_tile.at[pl.ds(s * seg, seg)], q_bar.at[wg])
        wgmma = functools.partial(with_layout, layout=plgpu.Layout.WGMMA, interpreted=interpreted)
        row_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(1), interpreted=interpreted)
        row = wg * ROWS + wgmma(lax.broadcasted_iota(jnp.int32, (ROWS, bk), 0))
        col = wgmma(lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1))
        q_pos = q_start + q0 + lax.rem(row, block_q)
        plgpu.barrier_wait(q_bar.at[wg])

        def mask(s, j):
            k_pos = j * bk + col
            visible = k_pos < kv_len
            if causal:
                visible = visible & (k_pos <= q_pos)
            if window is not None:
                visible = visible & (k_pos > q_pos - window)
            return jnp.where(visible, s, -jnp.inf)

        def scores(s, j, masked):
            s, _ = softcapped(s, softcap, scale)
            return mask(s, j) if masked else s

        def softmax(s, m, denom):
            p, m, denom, alpha = online_softmax(s, m, denom, softcapped(s, softcap, scale)[1])
            return m, denom, p, alpha

        def operand(ring, stage, free):
            return converted(ring, stage.at[wg], free, interpreted=interpreted) if staged else ring

        def release(free):  # a staged slot was handed back when it was converted
            if not staged:
                plgpu.barrier_arrive(free)

        # Block 0's scores, then for each next block: its q·kᵀ and this block's p·v go to the tensor
        # cores together, and the next block's softmax runs while p·v is still in flight.
        plgpu.barrier_wait(k_bar.at[0])
        s0 = scores(mma_transposed(q_tile, operand(k_smem.at[0], k_stage, k_free.at[0]), interpreted=interpreted), j0,
                    True)
        release(k_free.at[0])
        hd = q_smem.shape[-1]
        m, denom, p, _ = softmax(s0, row_vec(jnp.full((ROWS,), _NEG, jnp.float32)),
                                 row_vec(jnp.full((ROWS,), 0.0, jnp.float32)))
        p = p.astype(q_smem.dtype)
        acc = wgmma(jnp.full((ROWS, hd), 0.0, jnp.float32))
        zeros = wgmma(jnp.full((ROWS, bk), 0.0, jnp.float32))

        def step(j, carry, *, masked: bool):
            m, denom, p, acc = carry
            slot, nslot = lax.rem(j - j0, stages), lax.rem(j + 1 - j0, stages)
            plgpu.barrier_wait(k_bar.at[nslot])
            k_tile = operand(k_smem.at[nslot], k_stage, k_free.at[nslot])
            plgpu.barrier_wait(v_bar.at[slot])
            v_tile = operand(v_smem.at[slot], v_stage, v_free.at[slot])
            if window is not None:  # the first block: its keys behind every window may be another request's NaN
                pl.when(j == j0)(lambda: zero_rows_from(v_tile, bk, below=behind - j * bk, interpreted=interpreted))

            def scores_ready(s):
                release(k_free.at[nslot])
                return softmax(scores(s, j + 1, masked), m, denom)

            # The next p stays float32 until p·v is done: a wgmma's register operand must not be
            # written while one is in flight (ptxas would serialize every wgmma of the kernel).
            (m, denom, p, alpha), acc = mma_overlapped(
                q_tile, k_tile, acc, p, v_tile, scores_ready, (m, denom, zeros, m), zeros, interpreted=interpreted)
            release(v_free.at[slot])
            return m, denom, p.astype(q_smem.dtype), acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        # step j computes block j + 1's scores: masked below lo_full (the window's edge) and from num_full on
        edge = jnp.clip(lo_full - 1, j0, n - 1)
        last_full = jnp.clip(num_full - 1, edge, n - 1)
        carry = lax.fori_loop(j0, edge, functools.partial(step, masked=True), (m, denom, p, acc))
        carry = lax.fori_loop(edge, last_full, functools.partial(step, masked=False), carry)
        m, denom, p, acc = lax.fori_loop(last_full, n - 1, functools.partial(step, masked=True), carry)
        slot = lax.rem(n - 1 - j0, stages)
        plgpu.barrier_wait(v_bar.at[slot])
        v_tile = operand(v_smem.at[slot], v_stage, v_free.at[slot])

        # Unstaged, both compute warpgroups zero the same rows: they write identical values, so neither
        # can observe anything but V or zeros after its own writes. Only the last block crosses kv_len.
        @pl.when((n * bk > kv_len) | (behind > (n - 1) * bk))
        def _():
            zero_rows_from(v_tile, kv_len - (n - 1) * bk, below=None if window is None else behind - (n - 1) * bk,
                           interpreted=interpreted)

        acc = mma_accumulate(acc, p, v_tile, interpreted=interpreted)
        release(v_free.at[slot])
        denom = jnp.where(denom == 0.0, 1.0, denom)
        out = acc / lax.broadcast_in_dim(denom, acc.shape, [0])
        q_tile[...] = out.astype(q_tile.dtype)
        plgpu.commit_smem()
        for s, head, pos in segments(wg):
            plgpu.copy_smem_to_gmem(q_tile.at[pl.ds(s * seg, seg)], o_ref.at[b, pl.ds(pos, seg), head])
        plgpu.wait_smem_to_gmem(0)


def scheduled_span(lengths: list[int], sms: int | None = None) -> int:
    """When the last of these programs ends if each starts, in order, on the first SM to come free."""
    free = [0] * (sms or backend_lib.num_sms())
    for length in lengths:
        heapq.heappush(free, heapq.heappop(free) + length)
    return max(free)


@functools.lru_cache(maxsize=256)
def program_order(units: int, tile_blocks: tuple[int, ...]) -> int:
    """How many units' programs run interleaved, query tile by query tile (1, 2 or 4), given the key blocks
    of one unit's tiles in the order they start (longest first).

    The block scheduler starts programs in about grid order as SMs free up. Causal tiles shorten with
    their position, so with each unit's tiles in a row the last units' long tiles can start last and run
    on alone: in a simulation of that (a program's length its key blocks plus 2 for its start and end;
    anything from 0.5 to 3 chooses the same), about 6 % of a 4k causal call (64 units of 32 tiles), 5 % at
    8k, 0.1 % at 16k (16 units of 128). The fewest interleaved units within 0.5 % of the simulated best are
    taken, since more at once read more K/V at once (4 cost 2 % at 16k on the H100). Equal tiles: 1.
    """
    if len(set(tile_blocks)) == 1:
        return 1
    spans = {n: scheduled_span([blocks + 2 for _ in range(units // n) for blocks in tile_blocks for _ in range(n)])
             for n in (1, 2, 4) if units % n == 0}
    best = min(spans.values())
    return min(n for n, span in spans.items() if span <= best * 1.005)


MAX_GRID_Y = MAX_GRID_Z = 65535  # CUDA's limits on a grid's second and third dimensions


def _check(q, k_shape, bs: BlockSizes, kv_len_name: str):
    b, t, h, hd = q.shape
    kv = k_shape[0] if kv_len_name == "pages" else k_shape[2]
    group = h // kv
    if group % bs.heads_per_program:
        raise ValueError(f"heads_per_program={bs.heads_per_program} must divide the GQA group {h}//{kv}={group}")
    if bs.block_q < 16:
        raise ValueError(f"heads_per_program={bs.heads_per_program} leaves block_q={bs.block_q} < 16")
    if t % bs.block_q:
        raise ValueError(f"q_len={t} must be a multiple of block_q={bs.block_q} (128 // heads_per_program)")
    if hd % 64 or hd > 256:
        raise ValueError(f"head_dim={hd} must be a multiple of 64 and at most 256 for Mosaic GPU")
    if bs.block_k % 64:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of 64")
    return b, t, h, hd, kv, group


def _call(q, k, v, table, q_start, kv_len, *, paged: bool, causal: bool, sm_scale, softcap, window, bs: BlockSizes,
          interpret, dense_start: int | None = None):
    b, t, h, hd, kv, group = _check(q, k.shape, bs, "pages" if paged else "dense")
    dtype, kv_dtype = operand_dtypes(q.dtype, k.dtype, v.dtype, hd)
    staged = kv_dtype != dtype
    q, k, v = q.astype(dtype), k.astype(kv_dtype), v.astype(kv_dtype)
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else float(sm_scale)
    num_qt = t // bs.block_q
    nseg = ROWS // min(ROWS, bs.block_q)
    if paged:
        ps = k.shape[2]
        if ps % 8 or (ps < bs.block_k and bs.block_k % ps) or (ps > bs.block_k and ps % bs.block_k):
            raise ValueError(f"page_size={ps} and block_k={bs.block_k} must divide one another (and page_size % 8 == 0)")
        copies = max(1, bs.block_k // ps)
    else:
        copies = 1
    tr = mma_transforms(dtype)
    params = backend_lib.interpret_params("mosaic_gpu", interpret)
    head_groups = group // bs.heads_per_program
    units = b * kv * head_groups
    interleave = default_interleave(causal, dense_start, units, num_qt, bs) if bs.interleave is None else bs.interleave
    if interleave < 1 or units % interleave:
        raise ValueError(f"interleave={interleave} must be at least 1 and divide the (row, KV head, head group) "
                         f"units: {b} x {kv} x {head_groups} = {units}")
    if units // interleave > (MAX_GRID_Z if interleave > 1 else MAX_GRID_Y):
        raise ValueError(f"{units // interleave} program rows (batch {b} x KV heads {kv} x head groups {head_groups}"
                         f" / interleave {interleave}) exceed CUDA's grid limit; split the batch")
    grid, grid_names = ((units // interleave, num_qt, interleave), ("units", "qt", "interleaved")) if interleave > 1 \
        else ((units, num_qt), ("units", "qt"))  # the last axis varies fastest
    kernel = plgpu.kernel(
        functools.partial(_kernel, paged=paged, causal=causal, scale=scale, softcap=softcap, window=window, group=group,
                          bs=bs, num_qt=num_qt, kv_heads=kv, interleave=interleave, staged=staged,
                          interpreted=params is not None),
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=(
            plgpu.SMEM((COMPUTE_WGS, ROWS, hd), dtype, transforms=tr),
            plgpu.SMEM((bs.stages, bs.block_k, hd), kv_dtype, transforms=mma_transforms(kv_dtype)),
            plgpu.SMEM((bs.stages, bs.block_k, hd), kv_dtype, transforms=mma_transforms(kv_dtype)),
            *((plgpu.SMEM((COMPUTE_WGS, bs.block_k, hd), dtype, transforms=tr),) * (2 if staged else 0)),
            plgpu.Barrier(num_arrivals=nseg, num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=copies, num_barriers=bs.stages),
            plgpu.Barrier(num_arrivals=copies, num_barriers=bs.stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=bs.stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=bs.stages),
        ),
        grid=grid,
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=params,
    )
    return kernel(q, k, v, table, q_start, kv_len)


def default_interleave(causal: bool, dense_start: int | None, units: int, num_qt: int, bs: BlockSizes) -> int:
    """The interleave of a call: by program_order for dense causal calls, whose first query's position is known
    when tracing; 1 for non-causal ones (equal tiles) and paged chunks (their start is only known on device, and
    a chunk after a long prefix has near-equal tiles: not measured)."""
    if not causal or dense_start is None:
        return 1
    ends = [dense_start + (qt + 1) * bs.block_q for qt in reversed(range(num_qt))]
    return program_order(units, tuple(-(-end // bs.block_k) for end in ends))


def default_block_sizes(group: int, q_len: int, head_dim: int = 128) -> BlockSizes:
    """Heads of one group share a program when the chunk is short or the group is wide. Heads wider than 128 step
    64 keys at a time: at head_dim 256 the ring of 128-key K/V blocks (256 KiB in bfloat16) beside the two query
    tiles is past the 227 KiB of shared memory a block may use."""
    hpp = 1
    while hpp * 2 <= group and group % (hpp * 2) == 0 and (q_len % (128 // hpp) or hpp < 2):
        hpp *= 2
    while q_len % (128 // hpp) and hpp * 2 <= min(group, 8) and group % (hpp * 2) == 0:
        hpp *= 2
    return BlockSizes(heads_per_program=hpp, block_k=128 if head_dim <= 128 else 64)


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, softcap: float | None = None,
                    window: int | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """Dense flash attention (see reference.flash_attention); q_len and kv_len tile by the blocks."""
    b, t, h, _ = q.shape
    s = k.shape[1]
    bs = block_sizes or default_block_sizes(h // k.shape[2], t, q.shape[-1])
    if s % bs.block_k:
        raise ValueError(f"kv_len={s} must be a multiple of block_k={bs.block_k}")
    q_start = jnp.full((b,), s - t if causal else 0, jnp.int32)
    kv_len = jnp.full((b,), s, jnp.int32)
    table = jnp.zeros((b, 1), jnp.int32)
    out = _call(q, k, v, table, q_start, kv_len, paged=False, causal=causal, sm_scale=sm_scale, softcap=softcap,
                window=window, bs=bs, interpret=interpret, dense_start=s - t if causal else 0)
    return out.astype(q.dtype)


def paged_flash_attention(q, k_pages, v_pages, page_table, q_start, kv_lengths, *, causal: bool = True,
                          sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                          block_sizes: BlockSizes | None = None, interpret: bool | None = None) -> jax.Array:
    """Prefill chunk over K/V pages (see reference.paged_flash_attention), read page by page by TMA."""
    h = q.shape[2]
    bs = block_sizes or default_block_sizes(h // k_pages.shape[0], q.shape[1], q.shape[-1])
    ps = k_pages.shape[2]
    if block_sizes is None and ps > bs.block_k:  # blocks within a page: as wide as the default allows
        bs = dataclasses.replace(bs, block_k=math.gcd(ps, bs.block_k))
    out = _call(q, k_pages, v_pages, page_table.astype(jnp.int32), q_start.astype(jnp.int32),
                kv_lengths.astype(jnp.int32), paged=True, causal=causal, sm_scale=sm_scale, softcap=softcap, window=window,
                bs=bs, interpret=interpret)
    return out.astype(q.dtype)
