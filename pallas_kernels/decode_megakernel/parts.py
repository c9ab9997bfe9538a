"""Activations as int8 parts for int8 x int8 wgmma: the decode megakernel's products (mosaic_gpu.py). Each unit's
activations are split once, by a warpgroup of their own (converter.py), off the products' critical path, so that the
compute warpgroups multiply the int8 weights straight from shared memory with no conversion.

split_parts is the reference (XLA); split_tile the same split by one warpgroup in inline PTX; ring_product_parts the
products of a ring of weight tiles with the parts (int32 sums a 128-input run, weighted by the run's unit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.mosaic_gpu import with_layout
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu

PART_INPUTS = 128  # inputs sharing one exponent: one 128-byte swizzle row of int8
PARTS = 3  # 3 int8 parts: every bfloat16 value within 2^-14 of its run's largest exact (split_parts)
THREAD_INPUTS = 4  # inputs a thread of split_tile takes: the shortest chain a thread, for a converter on the critical path


def unit_columns(block_m: int) -> int:
    """Columns of the units of one tile of rows: block_m padded to a multiple of 32 (128 bytes a copy)."""
    return -(-block_m // 32) * 32


def split_parts(x: jax.Array, parts: int, block_m: int, rows: int) -> tuple[jax.Array, jax.Array]:
    """x [m, k] -> (int8 parts [rows · parts, k], float32 units [k // PART_INPUTS, rows // block_m · cols]), x's rows
    padded with zeros to `rows` (a multiple of block_m); cols = unit_columns(block_m), of which a tile of rows uses
    the first block_m. Each run of PART_INPUTS inputs of a row is written as
    unit · (d_0 + 256 d_1 + ... + 256^(parts-1) d_(parts-1)) with int8 digits d_j and a power-of-two unit such that
    the run's largest |x| is below 2^(8 · parts - 2) units: the lower digits are balanced in [-128, 127], the top one
    within ±64. Digit d_j of row i lies at row (i // block_m · parts + j) · block_m + i % block_m, so that a tile of
    block_m rows has its parts in parts · block_m contiguous rows.

    Exactness with 3 parts: a unit is 2^-21 to 2^-22 of the run's largest |x|, so every bfloat16 value within 2^-14
    of it is exact, and any other value (float32 mantissas, smaller values) is rounded to the unit: an error below
    2^-22 of the run's largest (for runs whose largest |x| is below 2^-104 the unit stays at 2^-126, an error below
    2^-127). Each part fewer moves both bounds by 2^8. A run holding inf or nan gets a nan unit, so its products
    are nan. The reference for split_tile; ring_product_parts multiplies the parts by the int8 weights exactly
    (int32) and sums each run times its unit in float32."""
    m, k = x.shape
    runs = x.astype(jnp.float32).reshape(m, k // PART_INPUTS, PART_INPUTS)
    if rows > m:
        runs = jnp.pad(runs, ((0, rows - m), (0, 0), (0, 0)))
    top = jnp.max(jnp.abs(runs), axis=-1)  # [rows, runs]
    exponent = lax.shift_right_logical(lax.bitcast_convert_type(top, jnp.int32), 23)  # top < 2^(exponent - 126)
    shift = 8 * parts - 2  # top < 2^shift units
    unit = lax.bitcast_convert_type(jnp.maximum(exponent - shift + 1, 1) << 23, jnp.float32)
    unit = jnp.where(jnp.isfinite(runs).all(axis=-1), unit, jnp.nan)  # (a max need not carry a nan through)
    q = jnp.round(runs / unit[..., None]).astype(jnp.int32)
    digits = []
    for _ in range(parts - 1):
        d = ((q + 128) & 255) - 128
        digits.append(d)
        q = lax.shift_right_arithmetic(q - d, 8)
    digits.append(q)
    values = jnp.stack(digits).astype(jnp.int8)  # [parts, rows, k]
    values = values.reshape(parts, rows // block_m, block_m, k).transpose(1, 0, 2, 3).reshape(rows * parts, k)
    units = unit.T.reshape(k // PART_INPUTS, rows // block_m, block_m)
    units = jnp.pad(units, ((0, 0), (0, 0), (0, unit_columns(block_m) - block_m)), constant_values=1.0)
    return values, units.reshape(k // PART_INPUTS, -1)


def _split_ptx(segment: int, parts: int, block_m: int, block_k: int, cols: int, row_bytes: int, inputs: int,
               gain: bool = False, rows: int = 0) -> str:
    """PTX of split_tile for one segment of `inputs` (4, 8 or 16) inputs a thread: thread t of the warpgroup takes
    segment t + 128 · segment of the tile (row, `inputs` inputs), its run's largest |x| by shuffles among the
    128 / inputs threads of the run, the parts digit by digit ((q + 128) >> 8 is the next digit's q), each part's
    `inputs` bytes stored at their swizzled place (128-byte rows in tiles of 8 rows × 128 inputs, the 16-byte chunk
    index xor the row), the unit by the run's first thread. Fewer inputs a thread: a shorter chain a thread (what a
    converter on the critical path wants), more segments for the same tile. Operands: $0 the thread, $1 $2 $3 the
    shared addresses of the tile (rows row_bytes apart), the parts and the units. With `gain`, $4 and $5 are those
    of a gain [block_k] float32 and of sums of squares [rows] float32: each input is multiplied by its gain before
    the split, and the squares of each of the first `rows` rows' inputs (as they came) are added into its sum."""
    per_row = block_k // inputs  # segments a row
    per_run = PART_INPUTS // inputs  # threads a run
    words = inputs // 4
    vec = {1: "", 2: ".v2", 4: ".v4"}[words]
    shift = 8 * parts - 2
    loads = "\n".join(f"ld.shared.v4.f32 {{v{4 * i}, v{4 * i + 1}, v{4 * i + 2}, v{4 * i + 3}}}, [xa+{16 * i}];"
                       for i in range(words))
    top = "\n".join(f"abs.f32 a, v{i}; max.NaN.f32 m, m, a;" for i in range(1, inputs))
    shuffles = "\n".join(f"shfl.sync.bfly.b32 m2, m, {1 << b}, 0x1f, 0xffffffff; max.NaN.f32 m, m, m2;"
                          for b in range(per_run.bit_length() - 1))
    scale = "\n".join(f"mul.f32 v{i}, v{i}, inv; cvt.rni.s32.f32 q{i}, v{i};" for i in range(inputs))
    stores = []
    for j in range(parts):
        pack = "\n".join(f"prmt.b32 t0, q{4 * w}, q{4 * w + 1}, 0x0040; prmt.b32 t1, q{4 * w + 2}, q{4 * w + 3}, 0x0040;"
                          f" prmt.b32 w{w}, t0, t1, 0x5410;" for w in range(words))
        ws = ", ".join(f"w{w}" for w in range(words))
        stores.append(f"""{pack}
            add.u32 pa, rb, {j * block_m // 8 * (block_k // 128) * 1024};
            st.shared{vec}.b32 [pa], {"{" + ws + "}" if words > 1 else ws};""")
        if j < parts - 1:
            stores.append("\n".join(f"add.s32 q{i}, q{i}, 128; shr.s32 q{i}, q{i}, 8;" for i in range(inputs)))
    gain_code = ""
    if gain:
        gain_loads = "\n".join(f"ld.shared.v4.f32 {{g{4 * i}, g{4 * i + 1}, g{4 * i + 2}, g{4 * i + 3}}}, [ga+{16 * i}];"
                                for i in range(words))
        squares = "\n".join(f"fma.rn.f32 ss, v{i}, v{i}, ss;" for i in range(1, inputs))
        gained = "\n".join(f"mul.f32 v{i}, v{i}, g{i};" for i in range(inputs))
        # a row's sum over its threads by shuffles first, then one shared add a warp: 64 adds to one address, one
        # after another, cost the converter ~40 us a layer
        lanes = min(32, per_row)  # threads of one row in a warp
        row_sum = "\n".join(f"shfl.sync.bfly.b32 s2, ss, {1 << b}, 0x1f, 0xffffffff; add.f32 ss, ss, s2;"
                             for b in range(lanes.bit_length() - 1))
        gain_code = f"""mad.lo.u32 ga, c, {4 * inputs}, $4;
        {gain_loads}
        mul.f32 ss, v0, v0;
        {squares}
        {row_sum}
        and.b32 t0, seg, {lanes - 1};
        setp.eq.u32 p, t0, 0;
        setp.lt.and.u32 p, row, {rows}, p;
        mad.lo.u32 ga, row, 4, $5;
        @p red.shared.add.f32 [ga], ss;
        {gained}"""
    return f"""{{
        .reg .u32 seg, row, c, run, idx, chunk, xa, r8, rb, pa, ua, e, ue, ub, ib, t0, t1, ga, w<{words}>;
        .reg .f32 g<{inputs}>, ss, s2;
        .reg .f32 v<{inputs}>, a, m, m2, inv;
        .reg .s32 q<{inputs}>;
        .reg .pred p;
        add.u32 seg, $0, {128 * segment};
        shr.u32 row, seg, {per_row.bit_length() - 1};
        and.b32 c, seg, {per_row - 1};
        shr.u32 run, c, {per_run.bit_length() - 1};
        and.b32 idx, c, {per_run - 1};
        mad.lo.u32 xa, row, {row_bytes}, $1;
        mad.lo.u32 xa, c, {4 * inputs}, xa;
        {loads}
        {gain_code}
        abs.f32 m, v0;
        {top}
        {shuffles}
        mov.b32 e, m;
        shr.u32 e, e, 23;
        sub.s32 ue, e, {shift - 1};
        max.s32 ue, ue, 1;
        shl.b32 ub, ue, 23;
        sub.s32 ib, 254, ue;
        shl.b32 ib, ib, 23;
        mov.b32 inv, ib;
        setp.eq.u32 p, e, 255;
        @p mov.b32 ub, 0x7fc00000;
        {scale}
        and.b32 r8, row, 7;
        shr.u32 rb, row, 3;
        mad.lo.u32 rb, rb, {block_k // 128}, run;
        shl.b32 rb, rb, 10;
        shl.b32 t0, r8, 7;
        add.u32 rb, rb, t0;
        mul.lo.u32 t1, idx, {inputs};
        shr.u32 chunk, t1, 4;
        and.b32 t1, t1, 15;
        xor.b32 t0, chunk, r8;
        shl.b32 t0, t0, 4;
        add.u32 rb, rb, t0;
        add.u32 rb, rb, t1;
        add.u32 rb, rb, $2;
        {chr(10).join(stores)}
        setp.eq.u32 p, idx, 0;
        mad.lo.u32 ua, run, {cols}, row;
        shl.b32 ua, ua, 2;
        add.u32 ua, ua, $3;
        @p st.shared.b32 [ua], ub;
        }}"""


def split_tile(raw, parts_ref, units_ref, *, rows: int, gain=None, squares=None) -> None:
    """The activation tile raw [block_m, >= block_k] float32 (shared memory, untiled; its rows' first block_k) -> its
    PARTS int8 parts parts_ref [PARTS · block_m, block_k] (tiled + swizzled for wgmma) and units_ref
    [block_k // PART_INPUTS, cols] (untiled), as split_parts would make them, by the warpgroup that calls it:
    THREAD_INPUTS inputs a thread, in inline PTX (_split_ptx). Only the tile's first `rows` rows are split (rounded up
    to what a pass of the warpgroup covers); the parts of the others are left as they were. `gain` [block_k] float32
    and `squares` [>= rows] float32 (shared memory, both or neither): the inputs are multiplied by the gain before the
    split (an RMS norm's gain), and the squares of each of the first `rows` rows' inputs, before it, are added into
    its entry of `squares` (for the norm's 1/rms, which multiplies the product's output instead). On the chip only."""
    block_k = parts_ref.shape[-1]
    block_m = parts_ref.shape[-2] // PARTS
    if raw.shape[0] != block_m or raw.shape[1] < block_k:
        raise ValueError(f"raw {raw.shape} must hold {block_m} rows of at least {block_k} inputs")
    row_bytes = 4 * raw.shape[1]
    segments = -(-rows * block_k // (128 * THREAD_INPUTS))
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, llvm

    swizzled = plgpu.RefType(transforms=(plgpu.TilingTransform((8, PART_INPUTS)), plgpu.SwizzleTransform(128)))

    if (gain is None) != (squares is None):
        raise ValueError("split_tile takes a gain and a sum of squares together, or neither")
    extra = () if gain is None else (gain, squares)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), swizzled, plgpu.RefType()) + (plgpu.RefType(),) * len(extra))
    def split(ctx, raw, parts_ref, units_ref, *more):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        address = [llvm.ptrtoint(i32, mgpu_utils.memref_ptr(r)) for r in (raw, parts_ref, units_ref, *more)]
        thread = arith.andi(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), mgpu_utils.c(127, i32))
        for segment in range(segments):
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [thread, *address],
                            _split_ptx(segment, PARTS, block_m, block_k, units_ref.type.shape[-1], row_bytes,
                                       THREAD_INPUTS, gain=bool(more), rows=rows),
                            ",".join("r" * (4 + len(more))), has_side_effects=True)

    split(raw, parts_ref, units_ref, *extra)


def ring_product_parts(w_smem, x_smem, e_smem, tile_bar, free_bar, rows, first, last, slot_of) -> jax.Array:
    """[64, block_m] float32: int8 weight rows `rows` times activations in int8 parts (split_parts' form) over ring
    steps [first, last), as qmm_gpu.ring_product takes them: x_smem [stages, PARTS · block_m, block_k] int8 (tiled +
    swizzled) and e_smem [stages, block_k // PART_INPUTS, unit_columns(block_m)] float32 units. Each 128-input run is one int8
    wgmma with both operands in shared memory (the weight rows as A, the parts K-major as B) into an int32
    accumulator of its own; its parts' sums are then weighted (1, 256, ...), times the run's units, into the float32
    total. No weight passes through registers."""
    block_m, block_k = x_smem.shape[1] // PARTS, x_smem.shape[2]
    chunks = [pl.ds(c, PART_INPUTS) for c in range(0, block_k, PART_INPUTS)]

    def weighted(total, sums, unit_of):  # total + the runs' sums of parts, each times its run's units
        for c, part in enumerate(sums):
            unit = unit_of(c)
            for j in range(PARTS):
                scale = lax.broadcast_in_dim(unit * float(256 ** j), (qmm_gpu.ROWS, block_m), [1])
                total = total + part[:, j * block_m:(j + 1) * block_m].astype(jnp.float32) * scale
        return total

    col_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(0), interpreted=False)

    def step(g, total):
        slot = slot_of(g)
        plgpu.barrier_wait(tile_bar.at[slot])

        def products(*acc_refs):
            for acc_ref, cols in zip(acc_refs, chunks):
                plgpu.wgmma(acc_ref, w_smem.at[slot, rows, cols], x_smem.at[slot, :, cols].transpose((1, 0)))
            plgpu.wgmma_wait(0)
            return [acc_ref[...] for acc_ref in acc_refs]

        sums = pl.run_scoped(products, *[plgpu.ACC((qmm_gpu.ROWS, PARTS * block_m), jnp.int32) for _ in chunks])
        total = weighted(total, sums, lambda c: col_vec(e_smem.at[slot, c, pl.ds(0, block_m)][...]))
        plgpu.barrier_arrive(free_bar.at[slot])  # the units are read: the slot goes back
        return total

    zeros = with_layout(jnp.zeros((qmm_gpu.ROWS, block_m), jnp.float32), plgpu.Layout.WGMMA, interpreted=False)
    return lax.fori_loop(first, last, step, zeros)
