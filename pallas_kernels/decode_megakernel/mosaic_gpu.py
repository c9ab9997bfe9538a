"""A decode megakernel for Hopper (Mosaic GPU): every decoder layer of a batch-1 int8 decode step, attention and the
new token's K/V write included, in one persistent kernel; its math is reference.decode_layers', on the same stacked
layouts.

A program an SM, four warpgroups a program, each a role of its own module: the producer (producer.py) copies every
weight tile, K/V block and staged input into a ring of STAGES slots; the converter (converter.py) turns a unit's
staged sums into int8 parts; the two compute warpgroups (compute.py, attention.py) multiply and attend. plan.py holds
what the kernel is built for (Config, its phases), program.py what a program's roles share (its refs, runs, counts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel.compute import compute
from pallas_kernels.decode_megakernel.converter import converter
from pallas_kernels.decode_megakernel.plan import COLS, ORDER, WARPGROUPS, Config, check_config, layer_products
from pallas_kernels.decode_megakernel.producer import producer
from pallas_kernels.decode_megakernel.program import Program, Refs, Scratch


def _kernel(body, *, out_type, scratch_types, grid, grid_names, num_threads, thread_name, compiler_params):
    """plgpu.kernel without its vmap wrapper (jax 0.10-0.11), which takes no refs: an operand given as a ref
    (jax.new_ref) is then the kernel's to write in place, as the K and V pages are."""
    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=num_threads, thread_name=thread_name)

    def kernel_body(*refs):
        pl.run_scoped(functools.partial(body, *refs), *scratch_types, collective_axes=thread_name)

    return pl.kernel(kernel_body, out_type=out_type, mesh=mesh, compiler_params=compiler_params, name="megakernel")


def megakernel(config: Config):
    """The kernel for `config`: (Refs' operands: the stacked int8 weight tiles, K and V pages (refs, written in
    place), gains, scales, cos | sin, x0, the page table, the length) -> each phase's float32 sums [layers, COLS, n]
    (rows :1 written; wo's are h1, down's h2) and each layer's squares of its input [layers, 128]."""
    def body(*refs):
        operands = len(refs) - len(Scratch._fields)
        pr = Program(config, Refs.of(refs[:operands]), Scratch(*refs[operands:]))
        pl.when(pr.wg == 3)(functools.partial(converter, pr))
        pl.when(pr.wg == 2)(functools.partial(producer, pr))
        pl.when(pr.wg < 2)(functools.partial(compute, pr))

    return _kernel(
        body,
        out_type=(*(jax.ShapeDtypeStruct((config.layers, COLS, ph.n), jnp.float32) for ph in config.phases),
                  jax.ShapeDtypeStruct((config.layers, 128), jnp.float32)),
        scratch_types=tuple(Scratch.types(config)),
        grid=(config.programs,), grid_names=("p",), num_threads=WARPGROUPS, thread_name="wg",
        # Without Pallas's automatic warpgroup syncs (one before each TMA copy a thread issues, one before and one
        # after each store to shared memory): every hand-over of shared memory between a warpgroup's threads has a
        # sync of its own. Between warpgroups the hand-overs are mbarriers, which every thread arrives at after its
        # own reads and writes. Within one: a store and the reads of it by other threads, or by wgmma and TMA, are
        # separated by commit_smem (a fence and a warpgroup sync); a store over what other threads or a wgmma read
        # before comes after one too (raw_smem: the split's commit; o_smem and ao_smem: wait_smem_to_gmem, which
        # syncs; P: the commit before it; the scales' and residual's copies: the fragment before's commit), and
        # semaphore_wait ends in a warpgroup sync before a copy that depends on it. split_tile's threads share
        # nothing across warps. With the automatic syncs, the 8 a K/V block at 16-position pages were most of what
        # those pages cost.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
    )


def decode_layers(cfg, st, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                  lengths: jax.Array, inv_freq: np.ndarray, page_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """reference.decode_layers in one kernel, for one row: x [1, d] (the new token, embedded), st the stacked int8
    layers (reference.stack_layers' tiles), K and V pages stacked (reference.stack_pages, bfloat16) of page_size
    positions, page_table [1, pages] int32, lengths [1] int32 (positions cached, at least 1; the new token's is next
    and its page must be in the table), inv_freq the rotary frequencies [head_dim / 2] -> (h [1, d] float32, the
    layers' output before the final norm; k_pages; v_pages with the new K/V written in place).
    Raises ValueError naming what the kernel does not take."""
    layers = st.gains.shape[0]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    check_config(cfg, page_size, k_pages.dtype)
    if x.shape != (1, cfg.hidden_size):
        raise ValueError(f"the megakernel decodes one row: x must be [1, {cfg.hidden_size}], got {x.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != 1 or lengths.shape != (1,):
        raise ValueError(f"one row: page_table must be [1, pages] and lengths [1], got {page_table.shape} and "
                         f"{lengths.shape}")
    if k_pages.shape != v_pages.shape or k_pages.ndim != 2 or k_pages.shape[1] != hd or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"K and V pages must be alike, [layers · kv heads · pool · page_size, {hd}] "
                         f"(reference.stack_pages), got {k_pages.dtype}{list(k_pages.shape)} and "
                         f"{v_pages.dtype}{list(v_pages.shape)}")
    if k_pages.shape[0] % (layers * kvh * page_size):
        raise ValueError(f"{k_pages.shape[0]} page rows are not {layers} layers of {kvh} KV heads' pools of "
                         f"{page_size}-position pages")
    if st.values[0].ndim != 3:
        raise ValueError(f"the megakernel reads stack_layers' weight tiles [tiles, 128, 256], got a weight of shape "
                         f"{list(st.values[0].shape)}: stack the layers with tiles=True")
    pool = k_pages.shape[0] // (layers * kvh * page_size)
    kernel = megakernel(Config(model=cfg, layers=layers, programs=backend_lib.num_sms(), page_size=page_size,
                               pool=pool))
    angles = lengths[0].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # RoPE at the new position
    cos_sin = jnp.broadcast_to(jnp.concatenate([jnp.cos(angles), jnp.sin(angles)]), (COLS, hd))
    x0 = jnp.pad(x.astype(jnp.float32), ((0, COLS - 1), (0, 0)))
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)  # written in place: the new token's K and V
    outs = kernel(*(v.reshape(-1, v.shape[-1]) for v in st.values), k_ref, v_ref, st.gains,
                  *st.scales, cos_sin, x0, page_table[0].astype(jnp.int32), lengths.astype(jnp.int32))
    h = outs[len(ORDER) - 1][layers - 1, :1]  # the last layer's down sums with the residual: h2
    return h, jax.freeze(k_ref), jax.freeze(v_ref)


__all__ = ["check_config", "decode_layers", "layer_products", "megakernel"]
