"""int8-weight matmul for Hopper in Pallas Mosaic GPU: bulk copies of int8 tiles, dequantized in registers, wgmma.

Decode multiplies a few activation rows by a large weight, so the time is the weight's bytes.
The product is computed transposed, outᵀ [n, m] = W [n, k] · xᵀ [k, m] ("swap AB"): the weight
is wgmma's A operand, 64 output channels (the fixed wgmma M) per compute warpgroup, and the
activations are its B operand with N = the rows m padded to 8. Padding m to 8 instead of to 64
keeps the tensor cores far from being the limit at batch 1.

One program owns `block_n` output channels (64 per compute warpgroup), `block_m` activation
rows, and one split of k. A producer warpgroup copies, for each `block_k` step, the int8 weight
tile [block_n, block_k] and the activation tile [block_m, block_k] into a ring of `stages`
shared-memory buffers (TMA, completing on one barrier per slot). Each compute warpgroup loads
its [64, block_k] int8 rows into registers, converts them to the activations' type (exact: |v| <= 127;
float16 by default, where x enters as x · X_SHIFT: BlockSizes.float16) and issues wgmma with A in registers
and the activation tile as a transposed (K-major) B from shared memory, one wgmma per 128 inputs (a
128-byte swizzle tile of int8; decode's steps take 256 inputs, so each weight row is read 256 contiguous
bytes at a time). The float32 product of each scale group is multiplied by that group's per-channel
scales and summed in registers; the tile is transposed back in registers and out [m, n] goes out
through shared memory by TMA, so no transpose follows the kernel. With several k splits each writes
a float32 partial, summed afterwards (decode has too few output tiles to fill 132 SMs) by a sum of
slices that XLA fuses into the product's consumer.

Stream-K (`BlockSizes.stream_k`, `_stream_k_kernel`) instead gives each of 132 programs an equal
run of (output tile, step) units, so no wave is partial; a default only where a device kind
measured a gain (STREAM_K_IDLE).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.flash_attention.mosaic_gpu import mma_transforms, mosaic_dtype, with_layout

ROWS = 64  # output channels per compute warpgroup: the wgmma M
ROW_MULTIPLE = 8  # activation rows are padded to a multiple of this (the wgmma N granule): callers may pad once
# What one wave of programs costs beyond its bytes, in bytes per SM: the pipeline's fill, about a
# microsecond of the SM's share (~25 GB/s) of HBM bandwidth. An estimate: it keeps short splits in check.
WAVE_BYTES_PER_SM = 40_000
WIDE_STEP_ROWS = 16  # up to this many activation rows, a step takes 256 inputs (see _resolve)
# Where BlockSizes.stream_k is None: by device kind, the share of the split grid's SMs (over its waves) left idle
# above which decode's products take stream-K. Measured on 4-layer 8B decode steps at batch 1, against the split
# grid in the same run: on the H200 stream-K for qkv and gate_up took 0.637 -> 0.598 ms; on the H100 it gained
# nothing in the step for qkv (0.683 against 0.681 ms) and gate_up lost in the kernel (45.8 -> 47.1 us), so it is
# off there (and on any kind not named).
STREAM_K_IDLE = {"H200": 0.1}
SMEM_BYTES = 232_448  # shared memory one program may use on the H100 (227 KiB)
_CONTRACT_K = (((1,), (1,)), ((), ()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic GPU quantized matmul."""

    block_n: int | None = None  # output channels per program, 64 per compute warpgroup; None: 128 where n allows
    block_k: int | None = None  # inputs per pipeline step, 64, 128 or 256; None: 256 (each weight row read 256
    # contiguous bytes at a time) for up to WIDE_STEP_ROWS rows where it divides k and the scale group and fits in
    # shared memory at the stages asked (3 if not), else 128, else 64
    block_m: int | None = None  # activation rows per program (wgmma N: multiple of 8, <= 256); None: m up to 128
    stages: int | None = None  # tiles in flight per program; None: 3 of 256 inputs or 4 of 128 (64-96 KiB of weight
    # covers the H100's memory latency), fewer of 128 where 4 do not fit in shared memory (wide activation tiles)
    num_splits: int | None = None  # k splits; None: the fewest that fill the chip (see default_splits)
    stream_k: bool | None = None  # one program an SM, each streaming an equal run of (output tile, step) units
    # (stream-K, see _stream_k_kernel): per-channel scales and one tile of rows only; num_splits is then unused.
    # None: stream-K for decode's few rows (up to WIDE_STEP_ROWS) where it takes the shapes and the split grid
    # would leave more of its waves' SMs idle than stream_k_idle() (and num_splits is not given)
    programs: int | None = None  # stream-K programs; None: backend_lib.num_sms() (fewer where there are fewer units)
    float16: bool = True  # multiply in float16: the activations enter as x · X_SHIFT in float16 and the int8
    # weights convert to float16 in two integer instructions per two values instead of bfloat16's three (see
    # int8_to_float16); the scales take the shift back. A program streams 11 % faster alone (32.8 against 29.5 GB/s,
    # 33 programs), the same at 132; a 4-layer 8B decode step at batch 1 was 1.5 % faster in each of 4 processes
    # (H100)


DEFAULT_BLOCK_SIZES = BlockSizes()  # what the model's products use (a benchmark may swap it while it traces)


def supports(m: int, n: int, k: int, group_size: int, dtype: Any) -> bool:
    """Whether the kernel takes these shapes with its default tiling (the API sends others to XLA under "auto")."""
    if not (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) and n % ROWS == 0 and k % 64 == 0
            and group_size % 64 == 0):
        return False
    try:
        _resolve(DEFAULT_BLOCK_SIZES, m, n, k, group_size)
    except ValueError:  # no tiling fits in shared memory
        return False
    return True


def smem_bytes(bs: BlockSizes, k: int, group: int) -> int:
    """Shared memory of one program: the tile ring (16-bit activations, int8 weights), the scales (none for
    stream-K, which applies them outside), the output
    tile (float32 partials when k is split), the barriers, and up to 1 KiB of alignment between buffers (the
    lowering counted 496 bytes more than the buffers alone at 128 rows)."""
    ring = bs.stages * (bs.block_m * bs.block_k * 2 + bs.block_n * bs.block_k)
    if bs.stream_k:  # no scales; float32 partials and a tile of zeros a warpgroup
        return ring + 2 * bs.block_n * bs.block_m * 4 + 8 * 2 * bs.stages + 1024
    k_split = k // bs.num_splits
    scales = max(1, k_split // group) * bs.block_n * 4
    out = bs.block_n * bs.block_m * (4 if bs.num_splits > 1 else 2)
    return ring + scales + out + 8 * (1 + 2 * bs.stages) + 1024


def _resolve(bs: BlockSizes, m: int, n: int, k: int, group: int) -> BlockSizes:
    if bs.block_k is None:  # 256 inputs a step for decode's few rows where they divide k and the group and fit at
        # 3 stages (measured at 8 rows; wider activation tiles keep 128 until measured), else 128, else 64
        if k % 256 == 0 and group % 256 == 0 and (bs.block_m or m) <= WIDE_STEP_ROWS:
            try:
                return _resolve(dataclasses.replace(bs, block_k=256, stages=bs.stages or 3), m, n, k, group)
            except ValueError:  # a split of k, a block_n or stages asked for that 256 does not divide or fit
                pass
        return _resolve(dataclasses.replace(bs, block_k=128 if k % 128 == 0 and group % 128 == 0 else 64), m, n, k,
                        group)
    block_n = bs.block_n or (128 if n % 128 == 0 else ROWS)
    block_k = bs.block_k
    block_m = bs.block_m or min(-(-m // ROW_MULTIPLE) * ROW_MULTIPLE, 128)
    if n % block_n or block_n % ROWS:
        raise ValueError(f"n={n} must be a multiple of block_n={block_n}, itself a multiple of {ROWS}")
    if block_k not in (64, 128, 256) or k % block_k or group % block_k:
        raise ValueError(f"block_k={block_k} must be 64, 128 or 256 and divide k={k} and the scale group {group}")
    if block_m % ROW_MULTIPLE or not ROW_MULTIPLE <= block_m <= 256:
        raise ValueError(f"block_m={block_m} must be a multiple of {ROW_MULTIPLE} in [{ROW_MULTIPLE}, 256] (the wgmma N)")
    if bs.stream_k:
        if bs.num_splits is not None:
            raise ValueError(f"stream_k divides the work by units, not k splits: num_splits={bs.num_splits} must be "
                             "left unset")
        if group != k or m > block_m:
            raise ValueError(f"stream_k takes per-channel scales (group={group} must be k={k}) and one tile of rows "
                             f"(m={m} must be at most block_m={block_m})")
        resolved = BlockSizes(block_n=block_n, block_k=block_k, block_m=block_m, stream_k=True, float16=bs.float16,
                              stages=bs.stages or (4 if block_k <= 128 else 3), num_splits=1,
                              programs=min(bs.programs or backend_lib.num_sms(), (n // block_n) * (k // block_k)))
        if (need := smem_bytes(resolved, k, group)) > SMEM_BYTES:
            raise ValueError(f"{resolved} needs {need} bytes of shared memory, more than the {SMEM_BYTES} a program has")
        return resolved
    splits = bs.num_splits or default_splits(m, n, k, group, block_n, block_k, block_m)
    idle = stream_k_idle() if bs.stream_k is None and bs.num_splits is None else None
    if idle is not None and group == k and m <= block_m <= WIDE_STEP_ROWS:
        programs = (n // block_n) * splits
        if programs < (1 - idle) * -(-programs // backend_lib.num_sms()) * backend_lib.num_sms():
            return _resolve(dataclasses.replace(bs, stream_k=True), m, n, k, group)
    k_split = k // splits if k % splits == 0 else 0
    if not k_split or k_split % block_k or (k_split % group and group % k_split):
        raise ValueError(f"num_splits={splits} must cut k={k} into multiples of block_k={block_k} that hold whole "
                         f"scale groups of {group} or lie inside one")
    resolved = BlockSizes(block_n=block_n, block_k=block_k, block_m=block_m, float16=bs.float16,
                          stages=bs.stages or (4 if block_k <= 128 else 3), num_splits=splits, stream_k=False)
    while bs.stages is None and resolved.stages > 2 and smem_bytes(resolved, k, group) > SMEM_BYTES:
        resolved = dataclasses.replace(resolved, stages=resolved.stages - 1)
    if (need := smem_bytes(resolved, k, group)) > SMEM_BYTES:
        raise ValueError(f"{resolved} needs {need} bytes of shared memory, more than the {SMEM_BYTES} a program has; "
                         f"use fewer stages, a smaller block_k or a smaller block_m (m={m})")
    return resolved


def stream_k_idle() -> float | None:
    """STREAM_K_IDLE for the default device (None: stream-K is not a default there)."""
    kind = jax.devices()[0].device_kind
    return next((idle for name, idle in STREAM_K_IDLE.items() if name in kind), None)


def default_splits(m: int, n: int, k: int, group: int, block_n: int, block_k: int, block_m: int) -> int:
    """The k split that streams the weight fastest: programs (tile, split) in whole waves over the SMs, few waves
    (each costs a pipeline refill), at least two steps per program, and few float32 partials (each split writes and
    rereads [n, m] of them)."""
    tiles = (n // block_n) * -(-m // block_m)
    steps = k // block_k
    best, best_cost = 1, math.inf
    for s in range(1, steps // 2 + 1):
        k_split = k // s
        if k % s or k_split % block_k or (k_split % group and group % k_split):
            continue
        programs = tiles * s
        sms = backend_lib.num_sms()
        waves = -(-programs // sms)
        # bytes moved (idle SMs of the last wave counted as moving nothing), refills, partials
        cost = n * k * waves * sms / programs + waves * sms * WAVE_BYTES_PER_SM + (8 * s * n * m if s > 1 else 0)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


# float16 activations are x · X_SHIFT (BlockSizes.float16): every bfloat16 x with 2^-13 (1.2e-4) <= |x| < 1.05e6
# exactly, smaller ones to within 2^-21 (4.8e-7); a larger shift would reach further up (post-norm activations and
# SiLU·up stay far below 1e6) at the price of the small values, which 2^-8 kept exact only from 2^-9.
X_SHIFT = 2.0 ** -4


def activation_rows(x: jax.Array, rows: int, *, float16: bool = True) -> jax.Array:
    """x [m, k] as the kernels' activation operand [rows, k]: x · X_SHIFT in float16 (BlockSizes.float16), else x
    in its 16-bit Mosaic dtype; padded with zero rows to `rows`, a kernel of its own (a decode step pads its rows
    once instead: ROW_MULTIPLE)."""
    dtype = jnp.float16 if float16 else mosaic_dtype(x.dtype)
    xp = (x.astype(jnp.float32) * (X_SHIFT if float16 else 1.0)).astype(dtype)
    if rows > x.shape[0]:
        xp = jnp.pad(xp, ((0, rows - x.shape[0]), (0, 0)))
    return xp


def stream_k_holder(count, units: int, programs: int):
    """The program of a stream-K grid (program p streams units [p·T // P, (p+1)·T // P) of T) that holds the
    count-th unit (1-based): ceil(count · P / T) - 1."""
    return lax.div(count * programs + units - 1, units) - 1


def int8_to_float16(w: jax.Array) -> jax.Array:
    """int8 [rows, cols] in the WGMMA register layout -> float16, exactly, two values a 32-bit register: the bytes
    go under a float16 exponent of 1024 (prmt), their sign bits flip (xor: 1024 + v + 128), and one float16x2
    subtraction of 1152 leaves v: two integer instructions and a subtraction per two values, where Mosaic GPU's
    int8 -> bfloat16 takes three and a subtraction (bfloat16's 7-bit mantissa cannot hold a byte, so the sign bit
    is split off by two ands). Only the register's low 16 bits (the two values) are read."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm, vector

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.float16, plgpu.Layout.WGMMA))
    def convert(ctx, w):
        del ctx
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pad = llvm.mlir_undef(ir.VectorType.get((1,), i16))
        word = llvm.mlir_undef(ir.VectorType.get((1,), i32))
        registers = np.empty_like(w.registers)
        for idx, reg in np.ndenumerate(w.registers):
            if ir.VectorType(reg.type).shape != [2]:
                raise NotImplementedError(f"int8_to_float16 takes 2 values a register, got {reg.type}")
            pair = mgpu_utils.vector_concat([vector.bitcast(ir.VectorType.get((1,), i16), reg), pad])
            out = llvm.inline_asm(i32, [pair], """{
                .reg .b32 s<3>;
                prmt.b32 s0, $1, 0x64, 0x4140;
                xor.b32 s1, s0, 0x00800080;
                mov.b32 s2, 0x64806480;
                sub.f16x2 $0, s1, s2;
                }""", "=r,r")
            out = llvm.insertelement(word, out, mgpu_utils.c(0, i32))
            registers[idx] = vector.bitcast(ir.VectorType.get((2,), ir.F16Type.get()), out)
        return mgpu.FragmentedArray(_registers=registers, _layout=w.layout, _is_signed=None)

    return convert(w)


def ring_product(w_smem, x_smem, tile_bar, free_bar, rows, first, last, slot_of, *, interpreted: bool) -> jax.Array:
    """[64, block_m] float32: int8 weight rows `rows` times the activations, over ring steps [first, last).

    w_smem [stages, block_n, block_k] int8 and x_smem [stages, block_m, block_k] (both tiled + swizzled) are the
    ring; step g is in slot slot_of(g), waited on tile_bar and handed back on free_bar. Each 128-input chunk of
    the weight rows is loaded straight into the WGMMA layout that A-in-registers needs (16-bit shared-memory reads,
    2 values each) and converted there to x_smem's type, float16 (int8_to_float16) or bfloat16 (exact: |v| <= 127);
    B is the activation tile read K-major (transposed), which the 16-bit wgmma takes without a transpose of x in
    memory. A step of 256 inputs is two 128-byte swizzle tiles a row, a wgmma each.

    The SM's own work per byte holds a program to ~30 GB/s in bfloat16 (H100 and H200 alike; the copies alone
    stream ~100 GB/s a program: benchmarks/sm_rate_gpu.py); the float16 conversion, one integer instruction fewer
    per two values, raised that to 32.8 GB/s (H100, 33 programs). Loading in the layout made for upcasting 8-bit
    data (32-bit reads, 4 values each) and moving the converted values into the WGMMA layout by a warp shuffle was
    slower: products of a decode step 2.459 against 2.387 ms on an H200, 0.5-1.5 % a product on an H100."""
    block_m, block_k = x_smem.shape[1], x_smem.shape[2]
    chunks = [pl.ds(c, min(block_k, 128)) for c in range(0, block_k, 128)]

    def weight_tile(slot, cols):
        w = with_layout(w_smem.at[slot, rows, cols][...], plgpu.Layout.WGMMA, interpreted=interpreted)
        if x_smem.dtype == jnp.float16 and not interpreted:
            return int8_to_float16(w)
        return w.astype(x_smem.dtype)

    if interpreted:  # the interpreter has no register A operand: the same products by jnp.dot
        def dot_step(g, acc):
            slot = slot_of(g)
            plgpu.barrier_wait(tile_bar.at[slot])
            for cols in chunks:
                acc = acc + lax.dot_general(weight_tile(slot, cols), x_smem.at[slot, :, cols][...], _CONTRACT_K,
                                            preferred_element_type=jnp.float32)
            plgpu.barrier_arrive(free_bar.at[slot])
            return acc

        return lax.fori_loop(first, last, dot_step, jnp.zeros((ROWS, block_m), jnp.float32))

    def accumulate(acc_ref):
        def step(g, carry):
            slot = slot_of(g)
            plgpu.barrier_wait(tile_bar.at[slot])
            # every chunk is converted before the first product is issued, so no register of an issued wgmma
            # is written while it runs
            tiles = [weight_tile(slot, cols) for cols in chunks]
            for tile, cols in zip(tiles, chunks):
                plgpu.wgmma(acc_ref, tile, x_smem.at[slot, :, cols].transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the tile is read before its slot is handed back to the producer
            plgpu.barrier_arrive(free_bar.at[slot])
            return carry

        lax.fori_loop(first, last, step, None)
        return acc_ref[...]

    return pl.run_scoped(accumulate, plgpu.ACC((ROWS, block_m), jnp.float32))


def store_transposed(tile: jax.Array, ref, *, interpreted: bool) -> None:
    """outᵀ's [64, block_m] tile in registers -> ref [block_m, 64] (a ref from .at[...]) in ref's dtype: the
    registers trade pairs (one shuffle) into the transposed layout, whose stores into a transposed view of ref
    write out's rows (the interpreter, which has no such view, transposes the value)."""
    if interpreted:
        ref[...] = tile.T.astype(ref.dtype)
    else:
        ref.transpose((1, 0))[...] = plgpu.layout_cast(tile.astype(ref.dtype), plgpu.Layout.WGMMA_TRANSPOSED)


def drain(free_bar, stages: int, first, last) -> None:
    """Waits for the hand-back of ring steps [first, last) on free_bar: every completion of a barrier is awaited
    before a kernel ends."""
    def wait(g, carry):
        plgpu.barrier_wait(free_bar.at[lax.rem(g, stages)])
        return carry

    lax.fori_loop(first, last, wait, None)


def sum_slots(parts: jax.Array, count: int) -> jax.Array:
    """parts[0] + ... + parts[count - 1]: a sum of slices, not a reduction, so XLA fuses it into the consumer."""
    return functools.reduce(operator.add, (parts[i] for i in range(count)))


def _kernel(x_ref, w_ref, s_ref, o_ref, x_smem, w_smem, s_smem, o_smem, s_bar, tile_bar, free_bar, *,
            bs: BlockSizes, k_split: int, group: int, partial: bool, interpreted: bool):
    # x_ref: [m_pad, k] f16 (x · X_SHIFT) or bf16 activations; w_ref: [n, k] int8 weight rows; s_ref: [groups, n] f32
    # o_ref: [m_pad, n] (out dtype), or [splits, m_pad, n] f32 partials when k is split
    # x_smem: [stages, block_m, block_k] like x; w_smem: [stages, block_n, block_k] int8 (both tiled + swizzled)
    # s_smem: [groups in a split, block_n] f32; o_smem: [compute wgs, block_m, 64]
    block_n, block_k, block_m, stages = bs.block_n, bs.block_k, bs.block_m, bs.stages
    nt, split, mt, wg = (lax.axis_index(a) for a in ("n", "split", "m", "wg"))
    compute_wgs = block_n // ROWS
    n0, m0, k0 = nt * block_n, mt * block_m, split * k_split
    steps = k_split // block_k
    segment = min(group, k_split) // block_k  # steps sharing one scale
    num_segments = steps // segment

    @pl.when(wg == compute_wgs)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(k0 // group, s_smem.shape[0]), pl.ds(n0, block_n)], s_smem, s_bar)

        def step(j, carry):
            slot = lax.rem(j, stages)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(free_bar.at[slot])  # every compute warpgroup is done with this slot

            k_at = k0 + j * block_k
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(n0, block_n), pl.ds(k_at, block_k)], w_smem.at[slot],
                                    tile_bar.at[slot])
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(m0, block_m), pl.ds(k_at, block_k)], x_smem.at[slot],
                                    tile_bar.at[slot])
            return carry

        lax.fori_loop(0, steps, step, None)
        drain(free_bar, stages, max(steps - stages, 0), steps)

    @pl.when(wg < compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        wgmma = functools.partial(with_layout, layout=plgpu.Layout.WGMMA, interpreted=interpreted)
        row_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(1), interpreted=interpreted)
        rows = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)  # this warpgroup's weight rows

        def segment_product(first):  # [64, block_m] f32: this warpgroup's rows over `segment` steps of the ring
            return ring_product(w_smem, x_smem, tile_bar, free_bar, rows, first, first + segment,
                                lambda j: lax.rem(j, stages), interpreted=interpreted)

        plgpu.barrier_wait(s_bar)

        def scaled_segment(seg, total):
            part = segment_product(seg * segment)
            g = (seg * segment * block_k) // group  # the scale row of this segment, within the split's rows
            scale = row_vec(s_smem.at[g, rows][...])
            if bs.float16:  # here, not on the scales before the call: that would be a kernel of its own each call
                scale = scale * (1 / X_SHIFT)
            return total + part * lax.broadcast_in_dim(scale, part.shape, [0])

        total = lax.fori_loop(0, num_segments, scaled_segment, wgmma(jnp.zeros((ROWS, block_m), jnp.float32)))
        store_transposed(total, o_smem.at[wg], interpreted=interpreted)  # out [block_m, 64], no transpose after
        plgpu.commit_smem()
        cols = pl.ds(n0 + wg * ROWS, ROWS)
        dst = o_ref.at[split, pl.ds(m0, block_m), cols] if partial else o_ref.at[pl.ds(m0, block_m), cols]
        plgpu.copy_smem_to_gmem(o_smem.at[wg], dst)
        plgpu.wait_smem_to_gmem(0)


def stream_k_plan(units_per_tile: int, tiles: int, programs: int) -> tuple[int, int]:
    """(slots, fragments): of a stream-K grid where program p takes units [p·T // P, (p+1)·T // P) of the T =
    tiles · units_per_tile units in tile-major order, the most programs that share one tile (each writes its
    partial to its own slot of the output) and the most tiles one program touches."""
    total = tiles * units_per_tile
    shares = [0] * tiles
    fragments = 0
    for p in range(programs):
        first, last = p * total // programs // units_per_tile, ((p + 1) * total // programs - 1) // units_per_tile
        fragments = max(fragments, last - first + 1)
        for t in range(first, last + 1):
            shares[t] += 1
    return max(shares), fragments


def _stream_k_kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, z_smem, tile_bar, free_bar, *, bs: BlockSizes,
                     k: int, slots: int, fragments: int, interpreted: bool):
    """Stream-K: the product as T = tiles × steps units (an output tile of block_n channels, block_k inputs), in
    tile-major order; program p of P streams units [p·T // P, (p+1)·T // P) through one copy ring, so every
    program moves the same bytes (no partial last wave) and its ring never refills. The run crosses tiles: each
    piece of a tile (a fragment) writes its float32 sum to slot i of o_ref [slots, m_pad, n], i being the
    fragment's place among the tile's pieces, and the piece ending the tile zeroes the slots after its own. The
    caller sums the slots and applies the per-channel scales (elementwise: XLA fuses it into the consumer)."""
    block_n, block_k, block_m, stages, programs = bs.block_n, bs.block_k, bs.block_m, bs.stages, bs.programs
    p, wg = lax.axis_index("p"), lax.axis_index("wg")
    compute_wgs = block_n // ROWS
    steps = k // block_k  # units a tile
    total = (o_ref.shape[2] // block_n) * steps
    begin, end = lax.div(p * total, programs), lax.div((p + 1) * total, programs)

    @pl.when(wg == compute_wgs)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def step(u, carry):
            g = u - begin  # this program's ring runs on across tiles
            slot = lax.rem(g, stages)

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(free_bar.at[slot])

            k_at = lax.rem(u, steps) * block_k
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(lax.div(u, steps) * block_n, block_n), pl.ds(k_at, block_k)],
                                    w_smem.at[slot], tile_bar.at[slot])
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k_at, block_k)], x_smem.at[slot], tile_bar.at[slot])
            return carry

        lax.fori_loop(begin, end, step, None)
        drain(free_bar, stages, jnp.maximum(end - begin - stages, 0), end - begin)

    @pl.when(wg < compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        rows = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)
        zeros = with_layout(jnp.zeros((ROWS, block_m), jnp.float32), plgpu.Layout.WGMMA, interpreted=interpreted)
        store_transposed(zeros, z_smem.at[wg], interpreted=interpreted)
        plgpu.commit_smem()

        def product(first, last):  # [64, block_m] f32 over units [first, last) of the ring
            return ring_product(w_smem, x_smem, tile_bar, free_bar, rows, first, last,
                                lambda u: lax.rem(u - begin, stages), interpreted=interpreted)

        first_tile, last_tile = lax.div(begin, steps), lax.div(end - 1, steps)
        def fragment(tile):  # the piece of `tile` in this program's run, if any
            @pl.when(tile <= last_tile)
            def _fragment():
                start, stop = jnp.maximum(begin, tile * steps), jnp.minimum(end, (tile + 1) * steps)
                total_tile = product(start, stop)
                # this fragment's place among the tile's: the tile's first unit lies in program
                # ceil((u + 1)·P / T) - 1, and every program from there to p holds a piece of it
                owner = stream_k_holder(tile * steps + 1, total, programs)
                piece = p - owner
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous fragment's tile has left o_smem
                store_transposed(total_tile, o_smem.at[wg], interpreted=interpreted)
                plgpu.commit_smem()
                cols = pl.ds(tile * block_n + wg * ROWS, ROWS)
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[piece, :, cols])

                @pl.when(stop == (tile + 1) * steps)
                def _zero_the_rest():  # the tile's last piece: no other program writes the slots after it
                    def zero(i, carry):
                        plgpu.copy_smem_to_gmem(z_smem.at[wg], o_ref.at[i, :, cols])
                        return carry

                    lax.fori_loop(piece + 1, slots, zero, None)

        for f in range(fragments):  # the tiles this program's units touch, in order
            fragment(first_tile + f)

        plgpu.wait_smem_to_gmem(0)


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, *, out_dtype: Any = None,
                     block_sizes: BlockSizes | None = None, interpret: bool | None = None) -> jax.Array:
    """x [m, k] times int8 values [n, k] with scales [groups, n] (see reference.quantized_matmul)."""
    m, k = x.shape
    n = values.shape[0]
    group = k // scales.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if n % ROWS or k % 64 or group % 64:
        raise ValueError(f"Mosaic GPU needs n={n} a multiple of {ROWS}, and k={k} and the scale group {group} "
                         "multiples of 64")
    bs = _resolve(block_sizes or DEFAULT_BLOCK_SIZES, m, n, k, group)
    splits, k_split = bs.num_splits, k // bs.num_splits
    m_pad = -(-m // bs.block_m) * bs.block_m
    shift = X_SHIFT if bs.float16 else 1.0  # x enters times this; the scales take it back
    xp = activation_rows(x, m_pad, float16=bs.float16)
    dtype = xp.dtype
    partial = splits > 1
    compute_wgs = bs.block_n // ROWS
    params = backend_lib.interpret_params("mosaic_gpu", interpret)
    int8_swizzle = min(bs.block_k, 128)  # int8: one byte per input, so a 128-byte swizzle spans 128 inputs
    w_transforms = (plgpu.TilingTransform((8, int8_swizzle)), plgpu.SwizzleTransform(int8_swizzle))
    ring = (plgpu.SMEM((bs.stages, bs.block_m, bs.block_k), dtype, transforms=mma_transforms(dtype)),
            plgpu.SMEM((bs.stages, bs.block_n, bs.block_k), jnp.int8, transforms=w_transforms))
    if bs.stream_k:
        slots, fragments = stream_k_plan(k // bs.block_k, n // bs.block_n, bs.programs)
        kernel = plgpu.kernel(
            functools.partial(_stream_k_kernel, bs=bs, k=k, slots=slots, fragments=fragments,
                              interpreted=params is not None),
            out_type=jax.ShapeDtypeStruct((slots, m_pad, n), jnp.float32),
            scratch_types=(
                *ring,
                plgpu.SMEM((compute_wgs, bs.block_m, ROWS), jnp.float32),  # a fragment's sums
                plgpu.SMEM((compute_wgs, bs.block_m, ROWS), jnp.float32),  # zeros
                plgpu.Barrier(num_arrivals=2, num_barriers=bs.stages),
                plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=bs.stages),
            ),
            grid=(bs.programs,), grid_names=("p",), num_threads=compute_wgs + 1, thread_name="wg", interpret=params,
        )
        out = sum_slots(kernel(xp, values), slots)
        return (out[:m] * (scales[0].astype(jnp.float32) / shift)).astype(out_dtype)
    o_dtype = jnp.float32 if partial else mosaic_dtype(out_dtype)
    out_type = jax.ShapeDtypeStruct((splits, m_pad, n) if partial else (m_pad, n), o_dtype)
    kernel = plgpu.kernel(
        functools.partial(_kernel, bs=bs, k_split=k_split, group=group, partial=partial,
                          interpreted=params is not None),
        out_type=out_type,
        scratch_types=(
            *ring,
            plgpu.SMEM((max(1, k_split // group), bs.block_n), jnp.float32),
            plgpu.SMEM((compute_wgs, bs.block_m, ROWS), o_dtype),
            plgpu.Barrier(num_arrivals=1),  # the scales copied
            plgpu.Barrier(num_arrivals=2, num_barriers=bs.stages),  # the weight and activation copies of a step
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=bs.stages),
        ),
        grid=(n // bs.block_n, splits, m_pad // bs.block_m),
        grid_names=("n", "split", "m"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        interpret=params,
    )
    out = kernel(xp, values, scales.astype(jnp.float32))
    if partial:
        out = sum_slots(out, splits)
    return out[:m].astype(out_dtype)
