"""On the chip: the decode megakernel's int8 parts (pallas_kernels.decode_megakernel.parts) against their
reference and float64.

    PYTHONPATH=. python3 benchmarks/s8_parts.py
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.decode_megakernel.parts import (  # noqa: E402
    PART_INPUTS,
    PARTS,
    ring_product_parts,
    split_parts,
    split_tile,
    unit_columns,
)
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu  # noqa: E402


def check(inputs: int, gained: bool = False) -> None:
    """On the chip: split_tile against split_parts, and ring_product_parts against float64, on activations over
    six decades (one row of 1e4s, one of 1e-2s) and random int8 weights; with `gained`, the inputs times a gain and
    each row's sum of squares too. Prints the errors; raises if they pass the bounds split_parts states."""
    import numpy as np

    block_m, block_k, parts = 8, 256, PARTS
    swizzled = (plgpu.TilingTransform((8, PART_INPUTS)), plgpu.SwizzleTransform(128))

    def body(x_ref, w_ref, g_ref, z_ref, parts_ref, units_ref, o_ref, sq_ref, raw, w_smem, x_smem, e_smem, o_smem,
             g_smem, sq_smem, bar, tile_bar, free_bar):
        for r in range(block_m):  # a row at a time, as the megakernel stages its batch's rows
            for half in range(2):  # (a copy moves at most 256 along a dimension)
                at = (pl.ds(r, 1), pl.ds(half * block_k, block_k))
                plgpu.copy_gmem_to_smem(x_ref.at[at], raw.at[at], bar)
        plgpu.copy_gmem_to_smem(w_ref, w_smem.at[0], bar)
        plgpu.copy_gmem_to_smem(g_ref, g_smem, bar)
        plgpu.copy_gmem_to_smem(z_ref, sq_smem, bar)
        plgpu.barrier_wait(bar)
        split_tile(raw, x_smem.at[0], e_smem.at[0], parts=parts, inputs=inputs,
                   **({"gain": g_smem, "squares": sq_smem} if gained else {}))
        plgpu.commit_smem()
        plgpu.barrier_arrive(tile_bar.at[0])
        acc = ring_product_parts(w_smem, x_smem, e_smem, tile_bar, free_bar, pl.ds(0, qmm_gpu.ROWS), 0, 1,
                                 lambda g: g, parts=parts)
        qmm_gpu.store_transposed(acc, o_smem.at[0], interpreted=False)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem.at[0], parts_ref)
        plgpu.copy_smem_to_gmem(e_smem.at[0], units_ref)
        plgpu.copy_smem_to_gmem(o_smem.at[0], o_ref)
        plgpu.copy_smem_to_gmem(sq_smem, sq_ref)
        plgpu.wait_smem_to_gmem(0)

    cols = unit_columns(block_m)
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((parts * block_m, block_k), jnp.int8),
                  jax.ShapeDtypeStruct((block_k // PART_INPUTS, cols), jnp.float32),
                  jax.ShapeDtypeStruct((block_m, qmm_gpu.ROWS), jnp.float32),
                  jax.ShapeDtypeStruct((32,), jnp.float32)),  # (a copy moves a multiple of 128 bytes)
        scratch_types=(
            plgpu.SMEM((block_m, 2 * block_k), jnp.float32),  # rows as the megakernel's staging holds them
            plgpu.SMEM((1, 2 * qmm_gpu.ROWS, block_k), jnp.int8, transforms=swizzled),
            plgpu.SMEM((1, parts * block_m, block_k), jnp.int8, transforms=swizzled),
            plgpu.SMEM((1, block_k // PART_INPUTS, cols), jnp.float32),
            plgpu.SMEM((1, block_m, qmm_gpu.ROWS), jnp.float32),
            plgpu.SMEM((block_k,), jnp.float32),
            plgpu.SMEM((32,), jnp.float32),
            plgpu.Barrier(num_arrivals=2 * block_m + 3),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        ))
    key_x, key_w, key_g = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(key_x, (block_m, block_k), jnp.float32)
    x = x * jnp.asarray([1e4, 1e-2, 1, 1, 1, 1, 1, 1], jnp.float32)[:, None]
    w = jax.random.randint(key_w, (2 * qmm_gpu.ROWS, block_k), -127, 128, jnp.int32).astype(jnp.int8)
    gain = jax.random.uniform(key_g, (block_k,), jnp.float32, 0.5, 2.0) if gained else jnp.ones(block_k, jnp.float32)
    zeros = jnp.zeros(32, jnp.float32)
    label = f"split_tile ({inputs} inputs a thread{', gained' if gained else ''})"
    if jax.default_backend() == "cpu":  # PTX: lower only
        jax.jit(kernel).trace(jnp.concatenate([x, x], axis=1), w, gain, zeros).lower(lowering_platforms=("cuda",))
        return print(f"{label} lowered for CUDA (no GPU here: nothing run)")
    staged = jnp.concatenate([x, jnp.full_like(x, 1e30)], axis=1)  # the split must read only each row's first block_k
    got_parts, got_units, out, squares = jax.jit(kernel)(staged, w, gain, zeros)
    squares = squares[:block_m]
    xg = x * gain
    want_parts, want_units = split_parts(xg, parts, block_m, block_m)
    parts_equal = bool(jnp.all(got_parts == want_parts))
    units_equal = bool(jnp.all(got_units[:, :block_m] == want_units[:, :block_m]))
    exact = np.asarray(xg, np.float64) @ np.asarray(w[:qmm_gpu.ROWS], np.float64).T  # [block_m, 64]
    rel = np.abs(np.asarray(out, np.float64) - exact).max(axis=1) / np.abs(exact).max(axis=1)
    want_squares = (np.asarray(x, np.float64) ** 2).sum(axis=1)
    squares_rel = np.abs(np.asarray(squares, np.float64) - want_squares).max() / want_squares.max() if gained else 0.0
    print(f"{label} == split_parts: parts {parts_equal}, units {units_equal}; products' largest error a row, relative "
          f"to the row's largest: {rel.max():.2e}" + (f"; sums of squares {squares_rel:.1e}" if gained else ""),
          flush=True)
    if not (parts_equal and units_equal and rel.max() < 1e-5 and squares_rel < 1e-5):
        raise SystemExit("s8 parts check failed")


if __name__ == "__main__":
    for n, gained in ((16, False), (4, False), (4, True)):
        check(n, gained)
