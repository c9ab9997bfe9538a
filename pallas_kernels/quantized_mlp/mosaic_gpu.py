"""The int8 MLP of a decode step as one Mosaic GPU kernel: gate_up, SiLU·up and down, with no kernel boundary.

Separate kernels lose at each boundary: gate_up's 224 output tiles (8B shapes) fill 1.7 waves of 132
SMs, so its second wave streams with 40 SMs idle; SiLU·up is a kernel of its own; down starts only
when every gate_up program has ended. Here one program an SM works through a static list of items:

- gate item i: channels [64 i, 64 i + 64) over all of d. Compute warpgroup 0 multiplies their gate
  rows, warpgroup 1 their up rows (the producer copies each half of the weight tile from
  values [f, 2 d]: a channel's gate row, then its up row). Warpgroup 1 hands its scaled sums to warpgroup 0 through
  shared memory; warpgroup 0 forms act = silu(r · s_g · g) · r · s_u · u for its 64 channels and
  stores them (bfloat16) into `act` [m, f] in global memory, then adds one to the semaphore of the
  down split that holds those channels.
- down item (t, s): output channels [128 t, 128 t + 128) over split s of f's inputs. It reads act,
  so its producer first copies the split's first weight tiles, then waits until every gate item of
  the split has signalled, then copies act's tiles. Its float32 sums go to slot s of the output;
  the caller sums the slots and applies the down scales (elementwise: fused into the residual add).

No weight depends on an activation, so a producer streams weights while its program waits. The item
lists come from a list schedule (`schedule`): gate items first, each to the program free earliest,
then down items split by split, each to the program that can start it earliest; a program never
waits on an item of its own list that comes later, and every program is resident (one an SM; the wrapper
refuses a device with fewer SMs than programs), so
the waits end. The semaphores (grid-shared, from pl.get_global) outlive the call: after every
program has finished, program 0 takes their counts back to zero.

Status: correct on the H100 (tests/kernels/test_quantized_mlp.py, marked gpu) but no faster than the separate
kernels it would replace (8B MLP at 8 rows, 4 down splits, device time, benchmarks/mlp_gpu.py: 72.8 against
71.7 us on an H100, 58.5 against 54.9 on an H200), so the model does not call it. The schedule leaves a third of
the programs idle for the kernel's last third, and a program cannot stream faster than its conversion allows
(~30 GB/s: benchmarks/sm_rate_gpu.py), so an idle SM's share of HBM is lost, on the H200 nearly all of it; taking
the epilogues off the compute warpgroups did not help (benchmarks/int8_gpu_notes.md, session 20).
`gate_up_silu` runs the gate items alone (splits=0).
"""

from __future__ import annotations

import functools
import heapq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.mosaic_gpu import mma_transforms, mosaic_dtype
from pallas_kernels.quantized_matmul.mosaic_gpu import ROW_MULTIPLE, ROWS, drain, ring_product, store_transposed, sum_slots

NUM_SMS = backend_lib.NUM_SMS
BLOCK_K = 256  # inputs a pipeline step: each weight row read 256 contiguous bytes at a time
STAGES = 3  # the default ring (shared memory allows up to ~5 at 8 rows)
MAX_ROWS = 16  # decode's few rows (the kernel's activation tile is [rows padded to 8, 256])
COPY_WORDS = 32  # a copy moves a multiple of 128 bytes: the item table and r are padded to it
SPLITS = (4, 7, 8, 14, 16)  # candidate down splits of f; `plan` picks the one whose schedule ends first
# What an item costs beyond its steps, in steps, as the schedule counts it: fitted to the H100 (8B MLP, 8 rows),
# where each item more a program took cost 5-10 us (splits 4 / 7 / 8 / 14: 73.5 / 78.5 / 86.0 / 97.4 us)
ITEM_STEPS = 5


def supports(m: int, d: int, f: int) -> bool:
    """Whether the kernel takes m rows, d = embed and f = ffn (per-channel scales only)."""
    return m <= MAX_ROWS and d % BLOCK_K == 0 and any(_fits(d, f, s) for s in SPLITS)


def _fits(d: int, f: int, splits: int) -> bool:
    return f % splits == 0 and (f // splits) % BLOCK_K == 0


def schedule(d: int, f: int, splits: int, programs: int) -> tuple[list[list[int]], float]:
    """(items of each program, the schedule's end in pipeline steps, each item counted ITEM_STEPS more).

    Items: gate item i is i (channels [64 i, 64 i + 64)); down item (t, s) is gates + s · tiles + t. A list
    schedule: gate items to the program free first, then down items split by split, each to the program that
    can start it first (when the program is free and the split's gate items are done)."""
    gates, tiles = f // ROWS, d // 128
    gate_steps = d // BLOCK_K + ITEM_STEPS
    free = [(0.0, p) for p in range(programs)]
    items: list[list[int]] = [[] for _ in range(programs)]
    done = np.zeros(gates)
    for i in range(gates):
        t, p = heapq.heappop(free)
        done[i] = t + gate_steps
        items[p].append(i)
        heapq.heappush(free, (done[i], p))
    if not splits:  # gate_up and SiLU only
        return items, max(t for t, _ in free)
    down_steps = f // splits // BLOCK_K + ITEM_STEPS
    ready = done.reshape(splits, gates // splits).max(axis=1)
    clock = {p: t for t, p in free}
    for s in range(splits):
        for t in range(tiles):
            p = min(clock, key=lambda q: (max(clock[q], ready[s]), clock[q], q))
            clock[p] = max(clock[p], ready[s]) + down_steps
            items[p].append(gates + s * tiles + t)
    return items, max(clock.values())


def depart(p, programs: int, counts) -> None:
    """The end of a program whose grid shares semaphores (pl.get_global): they outlive the call, so once every
    program has signalled its departure, program 0 takes each (semaphore, count) of `counts` back by count (to
    zero, where every program is done with it) and the departures back to zero."""
    departed = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
    plgpu.semaphore_signal(departed, 1, memory_scope="gpu")

    @pl.when(p == 0)
    def _():
        plgpu.semaphore_wait(departed, programs, memory_scope="gpu")
        for semaphore, count in counts:
            plgpu.semaphore_signal(semaphore, -count, memory_scope="gpu")


def filler(d: int, f: int, splits: int) -> int:
    """The item number that stands for no item: one past the last (gate items, then down items)."""
    return f // ROWS + d // 128 * splits


def plan(d: int, f: int, programs: int = NUM_SMS, splits: int | None = None) -> tuple[int, np.ndarray]:
    """(splits, the item table [programs, most items] int32 with filler() past a program's items), for `splits`
    (0: gate items only) or else for the split whose schedule ends first."""
    if splits is not None and splits != 0 and (splits < 1 or not _fits(d, f, splits)):
        raise ValueError(f"splits={splits} must cut f={f} into multiples of {BLOCK_K} (or be 0: gate_up and SiLU "
                         "only)")
    if splits is None:
        splits = min((schedule(d, f, s, programs)[1], s) for s in SPLITS if _fits(d, f, s))[1]
    items, _ = schedule(d, f, splits, programs)
    table = np.full((programs, max(map(len, items))), filler(d, f, splits), np.int32)
    for p, row in enumerate(items):
        table[p, : len(row)] = row
    return splits, table


def _kernel(table_ref, x_ref, r_ref, gu_ref, gs_ref, dw_ref, o_ref, act_ref,
            table_smem, r_smem, x_smem, w_smem, s_smem, s_rows, u_smem, a_smem, o_smem, start_bar, s_bar,
            dealt_bar, tile_bar, free_bar, u_bar, *, d: int, f: int, splits: int, programs: int, slots: int):
    # table_ref [programs, slots] int32; x_ref [m_pad, d] bf16; r_ref [m_pad] f32; gu_ref [f, 2 d] int8;
    # gs_ref [2 f] f32 (gate and up scales interleaved); dw_ref [d, f] int8; o_ref [splits, m_pad, d] f32;
    # act_ref [m_pad, f] bf16 (written by gate items, read by down items)
    p, wg = lax.axis_index("p"), lax.axis_index("wg")
    stages, block_m = x_smem.shape[0], x_smem.shape[1]
    gates, tiles = f // ROWS, d // 128
    gate_steps = d // BLOCK_K
    split_k = f // splits if splits else 0  # splits == 0: gate items only (dw_ref and o_ref are None)
    down_steps, gates_per_split = split_k // BLOCK_K, gates // max(splits, 1)
    ready = pl.get_global(plgpu.SemaphoreType.REGULAR((splits,))) if splits else None  # gate items done, by split
    n_items = filler(d, f, splits)  # an item number past the last: no item

    def steps_of(item):
        return jnp.where(item < gates, gate_steps, jnp.where(item < n_items, down_steps, 0))

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(table_ref.at[p], table_smem, start_bar)
        plgpu.copy_gmem_to_smem(r_ref, r_smem, start_bar)  # (both padded to 128 bytes: a copy's multiple)
        plgpu.barrier_wait(start_bar)
        def scales(j, item):
            @pl.when(item < gates)
            def _():
                plgpu.copy_gmem_to_smem(gs_ref.at[pl.ds(item * 2 * ROWS, 2 * ROWS)], s_smem.at[j], s_bar.at[j])

        for j in range(slots):  # the scales of this program's gate items
            scales(j, table_smem[j])

        def take_slot(g):
            slot = lax.rem(g, stages)

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(free_bar.at[slot])

            return slot

        def item_copies(j, item, g0):  # item j of this program, its first step g0 of the ring
            @pl.when(item < gates)
            def _gate():
                def step(i, carry):
                    slot, k = take_slot(g0 + i), i * BLOCK_K
                    for half in range(2):  # gate rows, then up rows, of channels [64 item, 64 item + 64)
                        plgpu.copy_gmem_to_smem(gu_ref.at[pl.ds(item * ROWS, ROWS), pl.ds(half * d + k, BLOCK_K)],
                                                w_smem.at[slot, pl.ds(half * ROWS, ROWS)], tile_bar.at[slot])
                    plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k, BLOCK_K)], x_smem.at[slot], tile_bar.at[slot])
                    return carry

                first = min(stages, gate_steps)
                lax.fori_loop(0, first, step, None)
                # the scales come gate, up, gate, up, ...: each compute warpgroup reads its half as one contiguous
                # row, so they are dealt out here, one value at a time, while the first copies are in flight
                plgpu.barrier_wait(s_bar.at[j])

                def deal(c, carry):
                    for half in range(2):
                        s_rows[j, half, c] = s_smem[j, 2 * c + half]
                    return carry

                lax.fori_loop(0, ROWS, deal, None)
                plgpu.barrier_arrive(dealt_bar.at[j])
                lax.fori_loop(first, gate_steps, step, None)

            if not splits:
                return

            @pl.when(jnp.logical_and(item >= gates, item < n_items))
            def _down():
                s, t = lax.div(item - gates, tiles), lax.rem(item - gates, tiles)
                k0 = s * split_k

                def weights(i):
                    slot = take_slot(g0 + i)
                    for half in range(2):
                        plgpu.copy_gmem_to_smem(dw_ref.at[pl.ds(t * 128 + half * ROWS, ROWS),
                                                          pl.ds(k0 + i * BLOCK_K, BLOCK_K)],
                                                w_smem.at[slot, pl.ds(half * ROWS, ROWS)], tile_bar.at[slot])

                def activations(i):
                    plgpu.copy_gmem_to_smem(act_ref.at[:, pl.ds(k0 + i * BLOCK_K, BLOCK_K)],
                                            x_smem.at[lax.rem(g0 + i, stages)], tile_bar.at[lax.rem(g0 + i, stages)])

                first = min(stages, down_steps)
                for i in range(first):  # the weights go ahead of the split's activations
                    weights(i)
                with jax.named_scope("wait_split"):
                    plgpu.semaphore_wait(ready.at[s], gates_per_split, decrement=False, memory_scope="gpu")
                for i in range(first):
                    activations(i)

                def step(i, carry):
                    weights(i)
                    activations(i)
                    return carry

                lax.fori_loop(first, down_steps, step, None)

        g0 = jnp.int32(0)
        for j in range(slots):
            # (compared only with numbers >= 0: the loaded value's comparisons are unsigned, so a filler of -1
            # read as a down item and the kernel waited forever)
            item = table_smem[j]
            item_copies(j, item, g0)
            g0 = g0 + steps_of(item)

        drain(free_bar, stages, g0 - jnp.minimum(g0, stages), g0)  # (no sign-dependent comparison of g0)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(start_bar)
        rows = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)

        def product(g0, steps):  # [64, block_m] f32: this warpgroup's weight rows times the ring's activations
            return ring_product(w_smem, x_smem, tile_bar, free_bar, rows, g0, g0 + steps,
                                lambda g: lax.rem(g, stages), interpreted=False)

        r = plgpu.layout_cast(r_smem.at[pl.ds(0, block_m)][...], plgpu.Layout.WGMMA.reduce(0))
        r = lax.broadcast_in_dim(r, (ROWS, block_m), [1])

        def scaled(total, j, half):  # the sums times their channels' scales and the rows' r
            scale = plgpu.layout_cast(s_rows.at[j, half][...], plgpu.Layout.WGMMA.reduce(1))
            return total * lax.broadcast_in_dim(scale, total.shape, [0]) * r

        def item_products(j, item, g0):  # item j of this program, its first step g0 of the ring
            @pl.when(item < gates)
            @jax.named_scope("gate_item")
            def _gate():
                total = product(g0, gate_steps)
                plgpu.barrier_wait(dealt_bar.at[j])

                @pl.when(wg == 1)
                def _up():
                    u_smem.at[j][...] = scaled(total, j, 1)
                    plgpu.barrier_arrive(u_bar.at[j])

                @pl.when(wg == 0)
                @jax.named_scope("silu_store_signal")
                def _gate_times_up():
                    g = scaled(total, j, 0)
                    plgpu.barrier_wait(u_bar.at[j])
                    u = plgpu.layout_cast(u_smem.at[j][...], plgpu.Layout.WGMMA)
                    act = g / (1.0 + jnp.exp(-g)) * u
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a_smem's last tile has left
                    store_transposed(act, a_smem.at[0], interpreted=False)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(a_smem.at[0], act_ref.at[:, pl.ds(item * ROWS, ROWS)])
                    if splits:
                        plgpu.wait_smem_to_gmem(0)  # written to global memory before the split hears of it
                        plgpu.semaphore_signal(ready.at[lax.div(item, gates_per_split)], 1, memory_scope="gpu")

            if not splits:
                return

            @pl.when(jnp.logical_and(item >= gates, item < n_items))
            @jax.named_scope("down_item")
            def _down():
                s, t = lax.div(item - gates, tiles), lax.rem(item - gates, tiles)
                total = product(g0, down_steps)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem's last tile has left
                store_transposed(total, o_smem.at[wg], interpreted=False)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[s, :, pl.ds(t * 128 + wg * ROWS, ROWS)])

        g0 = jnp.int32(0)
        for j in range(slots):
            item = table_smem[j]
            item_products(j, item, g0)
            g0 = g0 + steps_of(item)

        plgpu.wait_smem_to_gmem(0)

        if splits:
            @pl.when(wg == 0)
            def _depart():
                depart(p, programs, [(ready.at[s], gates_per_split) for s in range(splits)])


def _check(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, stages: int, interpret) -> None:
    m, d = x.shape
    f = gu_values.shape[0]
    if gu_values.shape != (f, 2, d):
        raise ValueError(f"expected gate_up values [f, 2, d={d}]; got {gu_values.shape}")
    if gu_scales.shape != (1, f, 2):
        raise ValueError(f"the kernel takes per-channel scales: gate_up [1, {f}, 2]; got {gu_scales.shape}")
    if r.shape != (m,):
        raise ValueError(f"r must hold one number a row: shape ({m},), got {r.shape}")
    if not 2 <= stages <= 4:
        raise ValueError(f"stages={stages} must be 2, 3 or 4 (the ring's shared memory at {MAX_ROWS} rows)")
    if backend_lib.interpret_params("mosaic_gpu", interpret) is not None:
        raise NotImplementedError("this kernel (its register conversion, grid-shared semaphores) has no interpreted "
                                  "form: run it on a GPU")


def _call(x, r, gu_values, gu_scales, down_values, splits, stages, compiler_params):
    """The kernel's outputs: (float32 parts [splits, m_pad, d], act [m_pad, f]), or (act,) for splits == 0."""
    m, d = x.shape
    f = gu_values.shape[0]
    splits, table = plan(d, f, splits=splits)
    programs, slots = table.shape
    device = jax.devices()[0]
    if splits and device.platform == "gpu" and getattr(device, "core_count", programs) < programs:
        # a program that is never resident never signals its gate items: the down items waiting on them would hang
        raise ValueError(f"the fused MLP runs {programs} programs that must all be resident at once; "
                         f"{device.device_kind} has {device.core_count} SMs")
    table = np.pad(table, ((0, 0), (0, -slots % COPY_WORDS)), constant_values=filler(d, f, splits))
    m_pad = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
    dtype = mosaic_dtype(x.dtype)
    xp = jnp.pad(x.astype(dtype), ((0, m_pad - m), (0, 0)))
    rp = jnp.pad(r.astype(jnp.float32), (0, -m % COPY_WORDS))
    int8_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    body = functools.partial(_kernel, d=d, f=f, splits=splits, programs=programs, slots=slots)
    act_type = jax.ShapeDtypeStruct((m_pad, f), dtype)
    inputs = (jnp.asarray(table), xp, rp, gu_values.reshape(f, 2 * d), gu_scales.reshape(2 * f).astype(jnp.float32))
    if splits:
        out_type, inputs = (jax.ShapeDtypeStruct((splits, m_pad, d), jnp.float32), act_type), inputs + (down_values,)
    else:  # no down weights in, no partial sums out
        out_type, gates_only = (act_type,), body

        def body(t, x_, r_, gu, gs, act, *scratch):
            return gates_only(t, x_, r_, gu, gs, None, None, act, *scratch)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=(
            plgpu.SMEM((table.shape[1],), jnp.int32),
            plgpu.SMEM((rp.shape[0],), jnp.float32),
            plgpu.SMEM((stages, m_pad, BLOCK_K), dtype, transforms=mma_transforms(dtype)),
            plgpu.SMEM((stages, 2 * ROWS, BLOCK_K), jnp.int8, transforms=int8_transforms),
            plgpu.SMEM((slots, 2 * ROWS), jnp.float32),  # a gate item's scales, gate and up interleaved
            plgpu.SMEM((slots, 2, ROWS), jnp.float32),  # the same, gate then up
            plgpu.SMEM((slots, ROWS, m_pad), jnp.float32),  # warpgroup 1's scaled up sums, a gate item each
            plgpu.SMEM((1, m_pad, ROWS), dtype),  # a gate item's act tile
            plgpu.SMEM((2, m_pad, ROWS), jnp.float32),  # a down item's sums
            plgpu.Barrier(num_arrivals=2),  # the item table and r copied
            plgpu.Barrier(num_arrivals=1, num_barriers=slots),  # a gate item's scales copied
            plgpu.Barrier(num_arrivals=1, num_barriers=slots),  # ... and dealt out by half
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # a step's two weight halves and activations
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups done with a slot
            plgpu.Barrier(num_arrivals=1, num_barriers=slots),  # warpgroup 1's up sums stored
        ),
        grid=(programs,), grid_names=("p",), num_threads=3, thread_name="wg", compiler_params=compiler_params,
    )
    return kernel(*inputs)


def quantized_mlp(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, down_values: jax.Array,
                  down_scales: jax.Array, *, splits: int | None = None, stages: int = STAGES,
                  compiler_params: Any = None, interpret: bool | None = None) -> jax.Array:
    """See reference.quantized_mlp: float32 [m, d]. Per-channel scales only; m up to MAX_ROWS. `splits`: of f
    for the down items (None: plan's choice). `compiler_params`: plgpu.CompilerParams, e.g. with a profile_dir,
    where the kernel's named regions (gate product, SiLU and store, ...) are traced per warpgroup."""
    m, d = x.shape
    f = gu_values.shape[0]
    _check(x, r, gu_values, gu_scales, stages, interpret)
    if down_values.shape != (d, f) or down_scales.shape != (1, d):
        raise ValueError(f"expected down values [d={d}, f={f}] with per-channel scales [1, {d}]; got "
                         f"{down_values.shape} and {down_scales.shape}")
    if not supports(m, d, f):
        raise ValueError(f"the fused MLP takes up to {MAX_ROWS} rows, d a multiple of {BLOCK_K} and f that some "
                         f"split in {SPLITS} cuts into multiples of {BLOCK_K}; got m={m}, d={d}, f={f}")
    if splits == 0:
        raise ValueError("splits=0 has no down items: that is gate_up_silu")
    parts, _ = _call(x, r, gu_values, gu_scales, down_values, splits, stages, compiler_params)
    return sum_slots(parts, parts.shape[0])[:m] * down_scales.reshape(d).astype(jnp.float32)


def supports_gate_up_silu(m: int, d: int, f: int) -> bool:
    """Whether gate_up_silu takes m rows, d = embed and f = ffn (per-channel scales only)."""
    return m <= MAX_ROWS and d % BLOCK_K == 0 and f % ROWS == 0


def gate_up_silu(x: jax.Array, r: jax.Array, gu_values: jax.Array, gu_scales: jax.Array, *, stages: int = STAGES,
                 compiler_params: Any = None, interpret: bool | None = None) -> jax.Array:
    """See reference.gate_up_silu: act [m, f] in x's dtype, the gate items alone (no down items, no semaphores):
    gate_up with SiLU·up in its epilogue, so no kernel of its own for it and act is all that goes out.

    Not called by the model. With the down kernel after it, the 8B MLP at 8 rows took 70.5 against 71.9 us for
    gate_up, SiLU·up in XLA and down (H100, benchmarks/mlp_gpu.py); but r must reach the kernel before the SiLU,
    as 128 bytes at least (a copy's multiple), and its pad (or 1/rms computed for rows padded to 32, with the rsqrt
    outside the reduction) cost the decode step more than the SiLU kernel saves: 3.701 -> 3.733 ms (32 layers)."""
    m, d = x.shape
    f = gu_values.shape[0]
    _check(x, r, gu_values, gu_scales, stages, interpret)
    if not supports_gate_up_silu(m, d, f):
        raise ValueError(f"gate_up_silu takes up to {MAX_ROWS} rows, d a multiple of {BLOCK_K} and f of {ROWS}; "
                         f"got m={m}, d={d}, f={f}")
    (act,) = _call(x, r, gu_values, gu_scales, None, 0, stages, compiler_params)
    return act[:m].astype(x.dtype)
