"""Stand-ins for the int8 matmul's ring step (`qmm_gpu.ring_product`), swapped in while a benchmark traces, to
measure what bounds the products: each does part of the real step's work, so its products are wrong but its time
is an upper bound on what a kernel doing that work could reach.

- "copies": each ring step's tiles are awaited and handed back untouched (no conversion, no product).
- "s8": no conversion; the int8 weight rows are wgmma's A operand straight from shared memory, times an int8 B of
  3 × block_m columns (the weight tile's own first rows, read K-major: a stand-in for activations split into three
  int8 parts), into an int32 accumulator. This is the main loop of a kernel whose weights never pass through
  registers.
- "s8chunk": "s8" with each 128-input run's sums taken out of an int32 accumulator of its own once the step's
  products are done: its three parts converted, weighted (1, 256, 65536) and scaled by a per-run factor into a
  float32 total. This is the loop of activations split into int8 parts with an exponent per 128 inputs, found
  where they are made instead of by a reduction over a whole row (a kernel of that kind was built and measured in
  session 22, slower per product, and removed: benchmarks/int8_gpu_notes.md).
"""

from __future__ import annotations

import contextlib
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.mosaic_gpu import with_layout
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu

S8_PARTS = 3  # int8 parts a stand-in activation row has in the "s8" probe


def copies_only(w_smem, x_smem, tile_bar, free_bar, rows, first, last, slot_of, *, interpreted: bool):
    def step(g, carry):
        slot = slot_of(g)
        plgpu.barrier_wait(tile_bar.at[slot])
        plgpu.barrier_arrive(free_bar.at[slot])
        return carry

    lax.fori_loop(first, last, step, None)
    zeros = jnp.zeros((qmm_gpu.ROWS, x_smem.shape[1]), jnp.float32)
    return with_layout(zeros, plgpu.Layout.WGMMA, interpreted=interpreted)


def s8_products(w_smem, x_smem, tile_bar, free_bar, rows, first, last, slot_of, *, interpreted: bool,
                by_chunk: bool = False):
    """The "s8" probe, or with by_chunk the "s8chunk" one (both described in the module's docstring)."""
    if interpreted:
        raise NotImplementedError("the s8 probes need the chip (or lowering for CUDA)")
    block_m, block_k = x_smem.shape[1], x_smem.shape[2]
    cols_b = S8_PARTS * block_m
    chunks = [pl.ds(c, min(block_k, 128)) for c in range(0, block_k, 128)]

    def products(g, acc_of):  # step g's wgmmas, chunk i into acc_of(i); then the slot goes back
        slot = slot_of(g)
        plgpu.barrier_wait(tile_bar.at[slot])
        for i, cols in enumerate(chunks):
            plgpu.wgmma(acc_of(i), w_smem.at[slot, rows, cols], w_smem.at[slot, pl.ds(0, cols_b), cols].transpose((1, 0)))
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(free_bar.at[slot])

    if not by_chunk:  # one int32 accumulator through the whole loop
        def accumulate(acc_ref):
            lax.fori_loop(first, last, lambda g, carry: products(g, lambda i: acc_ref), None)
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((qmm_gpu.ROWS, cols_b), jnp.int32))
        # the first block_m columns of the int32 sums, times zero: the products are used, the tile has its form
        return acc[:, :block_m].astype(jnp.float32) * 0.0

    def step(g, total):  # each chunk into an accumulator of its own, then scaled into the float32 total
        def chunk_sums(*acc_refs):
            products(g, lambda i: acc_refs[i])
            return [acc_ref[...] for acc_ref in acc_refs]

        sums = pl.run_scoped(chunk_sums, *[plgpu.ACC((qmm_gpu.ROWS, cols_b), jnp.int32) for _ in chunks])
        for i, part in enumerate(sums):
            scale = (g * len(chunks) + i + 1).astype(jnp.float32)  # stands in for the chunk's exponent
            weighted = sum(part[:, j * block_m:(j + 1) * block_m].astype(jnp.float32) * float(256 ** j)
                           for j in range(S8_PARTS))
            total = total + weighted * scale
        return total

    zeros = with_layout(jnp.zeros((qmm_gpu.ROWS, block_m), jnp.float32), plgpu.Layout.WGMMA, interpreted=False)
    return lax.fori_loop(first, last, step, zeros) * 0.0


PROBES = {"copies": copies_only, "s8": s8_products, "s8chunk": functools.partial(s8_products, by_chunk=True)}


@contextlib.contextmanager
def probe(name: str | None):
    """While tracing inside this block, the int8 ring step (the matmul's and the layer kernel's) is PROBES[name]
    (None: the real one)."""
    if name is not None and name not in PROBES:
        raise ValueError(f"probe={name!r}: expected one of {sorted(PROBES)}")
    from pallas_kernels.quantized_layer import mosaic_gpu as layer_gpu

    modules = (qmm_gpu, layer_gpu)  # the layer kernel imports the ring step by name
    real = qmm_gpu.ring_product
    for module in modules:
        module.ring_product = PROBES[name] if name else real
    try:
        yield
    finally:
        for module in modules:
            module.ring_product = real
