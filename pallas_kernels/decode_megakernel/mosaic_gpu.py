"""A decode megakernel for Hopper (Mosaic GPU): every decoder layer of a batch-1 int8 decode step, attention
included, in one persistent kernel; its math is reference.decode_layers', on the same stacked layouts.

`megakernel` still takes trials and stand-ins (benchmarks/megakernel_step_gpu.py), which time what a part of it
costs.
`decode_layers` is the served form: int8 products on activations split into int8 parts, every numeric, paged
attention with the new token's K/V written and folded in.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel.parts import PART_INPUTS, PARTS, ring_product_parts, split_tile, unit_columns
from pallas_kernels.flash_attention.mosaic_gpu import (
    mma_transforms,
    mma_transposed,
    online_softmax,
    with_layout,
    zero_rows_from,
)
from pallas_kernels.paged_attention.mosaic_gpu import mma_values_transposed
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu

BLOCK_N, BLOCK_K, COLS = 128, 256, 8  # output rows a tile, inputs a step, activation rows (the batch, padded)
CONTEXT = 256  # positions of K and V an attention head streams (the decode benchmarks' context)
ORDER = ("wqkv", "attn", "wo", "w_gate_up", "w_down")  # a layer's phases in a decode step's order
TRIALS = ("no-deps", "no-store-wait", "no-attn", "stale-deps", "poll-all", "x-warpgroup", "x-load",
          "no-split", "no-gain", "no-scale", "no-residual", "no-new", "no-fold", "no-write",
          "auto-barriers", "per-layer")  # see megakernel
PRODUCTS = tuple(name for name in ORDER if name != "attn")  # the phases with weights, in that order
LOG2E = 1.4426950408889634  # the softmax runs in base 2 (exp2)
P_SWIZZLE = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # P [keys, 16] bf16 and V beside it
NORMED = ("wqkv", "w_gate_up")  # the products whose inputs are RMS-normed (attention's, the MLP's): gains 0, 1


def _load_t(ref) -> jax.Array:
    """A [rows, 64] tile in shared memory -> [64, rows] float32 in the WGMMA layout."""
    v = backend_lib.gpu_load(ref.transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)
    return plgpu.layout_cast(v.astype(jnp.float32), plgpu.Layout.WGMMA)


def layer_products(cfg) -> dict[str, tuple[int, int]]:
    """(n, k) of each quantized product of a layer: output channels, inputs."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return {"wqkv": (qkv, d), "wo": (d, d), "w_gate_up": (2 * f, d), "w_down": (d, f)}

def s8_sums(w_smem, tile_bar, free_bar, rows, start, stop, slot_of, b_of):
    """int32 [64, COLS]: the int8 weight rows `rows` of ring steps [start, stop) (step u in slot slot_of(u)) times
    the int8 B that b_of(slot, u, c) gives for the step's 128 inputs from c ([COLS, 128], read K-major), by int8
    wgmma straight from shared memory (no conversion); each slot is handed back on free_bar once read."""
    def accumulate(acc_ref):
        def step(u, carry):
            slot = slot_of(u)
            plgpu.barrier_wait(tile_bar.at[slot])
            for c in range(0, BLOCK_K, 128):
                plgpu.wgmma(acc_ref, w_smem.at[slot, rows, pl.ds(c, 128)], b_of(slot, u, c).transpose((1, 0)))
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(free_bar.at[slot])
            return carry

        lax.fori_loop(start, stop, step, None)
        return acc_ref[...]

    return pl.run_scoped(accumulate, plgpu.ACC((qmm_gpu.ROWS, COLS), jnp.int32))


def _kernel(body, *, out_type, scratch_types, grid, grid_names, num_threads, thread_name, compiler_params):
    """plgpu.kernel without its vmap wrapper (jax 0.10-0.11), which takes no refs: an operand given as a ref
    (jax.new_ref) is then the kernel's to write in place, as the K and V pages are."""
    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=num_threads, thread_name=thread_name)

    def kernel_body(*refs):
        pl.run_scoped(functools.partial(body, *refs), *scratch_types, collective_axes=thread_name)

    return pl.kernel(kernel_body, out_type=out_type, mesh=mesh, compiler_params=compiler_params, name="megakernel")


def check_config(cfg, page_size: int, page_dtype=jnp.bfloat16, programs: int | None = None) -> None:
    """Raises ValueError naming what of the model or the pages the kernel (megakernel, decode_layers) does not take:
    a head is a tile of BLOCK_N, every product's outputs whole tiles and its inputs whole steps of BLOCK_K, a head a
    program, the pages bfloat16 and a multiple of 8 positions dividing a K/V block of BLOCK_N. megakernel's
    callers run it (it does not)."""
    if cfg.head_dim != BLOCK_N:
        raise ValueError(f"the decode megakernel takes head_dim {BLOCK_N} (a head is a tile), got {cfg.head_dim}")
    for name, (n, k) in layer_products(cfg).items():
        if n % BLOCK_N or k % BLOCK_K:
            raise ValueError(f"the decode megakernel takes products of whole [{BLOCK_N}, {BLOCK_K}] tiles: {name} is "
                             f"[{n}, {k}]")
    programs = programs or backend_lib.num_sms()
    if not cfg.num_heads <= programs or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"the decode megakernel runs a query head a program: num_heads must be at most {programs} "
                         f"and a multiple of num_kv_heads, got {cfg.num_heads} and {cfg.num_kv_heads}")
    if page_size % 8 or BLOCK_N % page_size:
        raise ValueError(f"the decode megakernel takes pages of a multiple of 8 positions that divides {BLOCK_N}, got "
                         f"page_size={page_size}")
    if jnp.dtype(page_dtype) != jnp.bfloat16:
        raise ValueError(f"the decode megakernel reads bfloat16 K/V pages, got {jnp.dtype(page_dtype)}")


def writes_new_token(numerics: bool, attention: str, trials) -> bool:
    """Whether the kernel writes the step's new K/V into its page (every numeric and real attention, unless a
    trial leaves it out): what --check then compares."""
    return numerics and attention == "real" and not set(trials) & {"no-new", "no-write"}


def qkv_tiles(cfg, head):
    """(q, k, v) tiles of qkv's sums for a head (an int or traced), in the served order (jaxserve.model.weights.Layer:
    by KV head, its query heads, its key, its value; a tile is a head: head_dim == BLOCK_N)."""
    group = cfg.num_heads // cfg.num_kv_heads
    g, i = divmod(head, group) if isinstance(head, int) else (lax.div(head, group), lax.rem(head, group))
    return g * (group + 2) + i, g * (group + 2) + group, g * (group + 2) + group + 1


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    n: int  # output columns (weight rows)
    k: int  # inputs
    tiles: int
    steps: int  # units a tile
    fragments: int  # the most tiles a program's run touches
    stream_k: bool  # False: attention, a head a program
    out: int = 0  # the layer's phase (in its order) whose output this block writes: a phase is split in blocks
    tile0: int = 0  # the block's first tile and first step of 256 inputs in its phase
    step0: int = 0
    rotate: int = 0  # program p takes the stream-K run of program (p + rotate) mod programs: each block of a phase
    # turns its runs so that a program's longer runs in one block are evened out by shorter ones in the others

    @property
    def units(self) -> int:
        return self.tiles * self.steps


def plan(cfg, programs: int, split: int = 1, names=ORDER) -> tuple[Phase, ...]:
    """The blocks of a layer in the order the programs take them: attention as one; a product in split · split
    blocks of (tiles / split, inputs / split), tile groups outer, each block stream-K over every program, so that the
    first tile groups of a phase are done while its last are still running, and the next phase, taking its inputs
    in the same order, starts on them without waiting for the phase's end. (Attention's steps are those of CONTEXT;
    with real attention the kernel takes them from the step's length.)"""
    products = layer_products(cfg)
    phases = []
    for out, name in enumerate(names):
        if name == "attn":  # a head's K and V (bfloat16) as units of [128, 256] bytes
            steps = CONTEXT // BLOCK_N * 2 * cfg.head_dim * 2 // BLOCK_K
            phases.append(Phase(name, cfg.num_heads * cfg.head_dim, BLOCK_K, cfg.num_heads, steps, 1, False, out))
            continue
        n, k = products[name]
        tiles, steps = n // BLOCK_N, k // BLOCK_K
        if tiles % split or steps % split:
            raise ValueError(f"split={split} must divide {name}'s {tiles} tiles and {steps} steps of {BLOCK_K} inputs")
        t, s = tiles // split, steps // split
        runs = [(v + 1) * t * s // programs - v * t * s // programs for v in range(programs)]  # a block's, by program
        totals = [0] * programs  # of the phase so far, by program
        for a in range(split):
            for b in range(split):  # the turn that keeps the phase's longest total shortest
                turn = min(range(programs), key=lambda r: max(totals[p] + runs[(p + r) % programs]
                                                              for p in range(programs)))
                totals = [totals[p] + runs[(p + turn) % programs] for p in range(programs)]
                phases.append(Phase(name, n, k, t, s, qmm_gpu.stream_k_plan(s, t, programs)[1], True, out, a * t,
                                    b * s, turn))
    return tuple(phases)


def megakernel(cfg, layers: int, programs: int, stages: int, out_rows: int, trial: str = "",
               products: str = "s8", convert: bool = False, prefetch: int = 0, split: int = 1, split_inputs: int = 4,
               numerics: bool = False, attention: str = "stand-in", page_size: int = 16, pool: int = 64,
               eps: float = 1e-5, weight_tiles: bool = False):
    """(weights [layers · n, k] int8 for qkv, wo, gate_up, down (`weight_tiles`: reference.stack_layers' tiles
    [layers · n / 128 · k / 256, 128, 256] as rows of 256, so that a unit's copy reads 32 KB of contiguous bytes);
    K/V [layers · kv heads · steps · 128, 256] int8; without `convert`, stand-in B [8, k] int8 for each phase) ->
    each phase's float32 output [layers, 8, n] (rows :out_rows written). Trials (comma-joined; outputs wrong, time
    a bound): "no-deps" leaves out the waits for the tiles a unit's inputs come from; "no-store-wait" counts a piece
    without waiting for its reduce-add to land; "no-attn" leaves out the attention phase (wo waits for qkv's first tiles
    instead); "stale-deps" polls the same counts for what the call before reached (the polls' cost without the
    waiting). Right outputs, other ways to wait: "poll-all" reads a unit's counts at once (again until all are
    reached) instead of one wait after another; "x-warpgroup" moves the activations' waits and copies to a warpgroup
    of their own, so the weights' copies never wait on them; "x-load" (with `convert`) has the converter wait and read
    the sums from global memory by its own loads instead of a copy by the producer through the SM's copy engine (where
    it queues behind the weights' copies); "no-split" (with s8 `convert`) has the converter leave the parts as they
    were (wrong: the split's cost). With `numerics`, each leaves one part of them out (wrong, the part's cost):
    "no-gain" the gains and squares in the split (and their copies), "no-scale" the scales' copies and multiplies,
    "no-residual" the residual stream, "no-new" (with real attention) the new token's K/V: not written, not attended;
    "no-fold" written, not attended; "no-write" attended, not written. "per-layer" (right outputs): each layer's
    weights and (real attention) K and V pages are arrays of their own, as the engine holds them (a weight [n, k], a
    pool [kv heads · pool · page, hd]), each copy choosing its layer's array by a tree of branches on the layer,
    instead of one array of every layer. "auto-barriers" (right outputs): Pallas's automatic warpgroup syncs around
    every copy and store, which the kernel otherwise leaves out (see its compiler_params).
    `products`: "s8" (int8
    wgmma, no conversion) or "float16" (the served kernels' step, ring_product: each weight
    chunk converted to float16 in registers, B a float16 stand-in). `convert`: a unit's activations are
    no stand-in but the phase before's float32 sums, copied (the program's rows) into a staging ring and converted
    (SiLU(gate)·up for down, from the interleaved gate_up sums) by a fourth warpgroup into the activation ring, as
    the real kernel must (its gains and 1/rms are a multiply more): with float16 products to float16 times X_SHIFT;
    with s8 products split into 3 int8 parts and a unit per 128 inputs (parts.split_tile), which
    the compute warpgroups multiply by int8 wgmma with no conversion of the weights (parts.ring_product_parts:
    B of 3 · 8 columns, an int32 sum a 128-input run, weighted into a float32 total). `prefetch` D > 0:
    each weight copy also asks for the weights of the ring step D later into L2 (a TMA prefetch), so HBM keeps
    streaming while a boundary's waits hold the ring. `split` S > 1: each product in S · S blocks (see plan).
    `split_inputs`: inputs a converter thread splits (s8 `convert`; 16, or 4 for a shorter chain), only
    the batch's rows (`out_rows`). `numerics` (s8 `convert`): the work of the norms and the scales, on stand-in
    values: qkv's and gate_up's units have their norm's gain staged beside their sums (one copy of 256 sums and one
    of 256 gains) and the split multiplies by it; gate_up's first 16 units of a program's run (every input step
    once: runs are longer) add each row's squares into the program's sum for the layer, from which down's converter
    multiplies gate and up by 1/rms (a number a row); each piece is multiplied by its rows' per-channel scales,
    copied in by its compute warpgroup as its fragment starts; and the residual stream: the piece holding a wo or
    down tile's first input step adds the layer's input (wo) or wo's sums (down) to its partial sums, so that wo's
    sums are h1 and down's h2, as the model's. Inputs: gains [layers, 2, d] and a float32 [layers · n] of scales a
    product. With real attention too (`full`, one row): the squares of the layer's input come from the programs
    holding qkv's tile 0 (every input step once), each reduce-adding its sum into the layer's and counting it;
    attention multiplies q, k and v by the 1/rms and rotates k as q; the converter rounds them to bfloat16, and
    hands wg0 the new token's k (the first row of a 64-key tile) and v, which wg0 folds into the online softmax
    after the cached blocks as a block of 64 keys, all but the first masked
    (the step's own K/V never go through the cache in the step that makes them: a tail block read back cost 3.3 us
    a layer); the group's first head writes them into the next position of the sequence's pages.
    `attention`: "stand-in" (a head's K and V bytes through the ring, multiplied as a product's) or "real" (s8
    `convert`): the head's q
    from qkv's sums, rotated (RoPE, from a cos/sin input) by the converter into bfloat16; its K and V as bfloat16
    blocks of 128 positions through the ring, in the order K, V, K, V (bfloat16 views of the ring's slots); scores as
    K·qᵀ by wgmma, an online softmax, and Vᵀ·P by wgmma, all by compute warpgroup 0 (1 only waits for and hands back
    the slots); the head's [rows, 128] output stored to the phase's sums. Real attention reads K and V from
    pages (k and v [layers · kv heads · pool · page_size, hd] bfloat16, a page table and the length, one sequence):
    ceil(length / 128) blocks, each as page_size-position TMA copies on kv_bar, scores past the length masked and
    the last block's V rows past it zeroed. Not done (for the served kernel): rows past 1, each with its pages."""
    trials = set(filter(None, trial.split(",")))
    unknown = trials - set(TRIALS)
    if unknown:
        raise ValueError(f"unknown trials {sorted(unknown)}; known: {', '.join(TRIALS)}")
    x_warpgroup = "x-warpgroup" in trials
    per_layer_refs = "per-layer" in trials
    x_load = "x-load" in trials
    if x_load and not convert:
        raise ValueError("x-load is for --convert (the converter loads the sums)")
    x_wg = 4 if convert else 3  # the activations' warpgroup, after the converter if there is one
    warpgroups = 3 + convert + x_warpgroup
    parts = convert and products == "s8"  # the converter splits the sums into int8 parts (parts.split_tile)
    if attention not in ("stand-in", "real"):
        raise ValueError(f"attention must be 'stand-in' or 'real', got {attention!r}")
    real_attention = attention == "real"
    if real_attention and (not parts or "x-load" in trials):
        raise ValueError("real attention is for --products s8 --convert without x-load (its converter makes q "
                         "from sums the producer stages)")
    if numerics and (not parts or x_load):
        raise ValueError("numerics is for --products s8 --convert without x-load (the producer stages the gains "
                         "beside the sums, and the converter's split takes them)")
    if numerics and split != 1:
        raise ValueError(f"numerics sums a row's squares over a program's gate_up units of every input step: split "
                         f"must be 1, got {split}")
    if trials & {"no-gain", "no-scale", "no-residual"} and not numerics:
        raise ValueError("no-gain, no-scale and no-residual leave out a part of --numerics: give it")
    full = numerics and real_attention  # the whole of a decode layer's numerics (see the docstring)
    if numerics and real_attention and "no-new" not in trials and stages > 2:
        raise ValueError(f"numerics with real attention needs stages <= 2 (at 3 its shared memory is ~240 KB of the "
                         f"H100's 227 KB a block; without the new token's fold tiles it fits), got {stages}")
    if real_attention and out_rows != 1:
        raise ValueError(f"real attention reads one sequence's pages (and with numerics writes its new token's K/V): "
                         f"rows must be 1, got {out_rows}")
    # (the step's length must be at least 1: with no K/V block attention would count no tile, and wo would wait on)
    if "no-split" in trials and not parts:
        raise ValueError("no-split is for --products s8 --convert (the converter's split into parts)")
    # Registers a thread: the block's 64K at launch, a share each (in steps of 8); the producer and the activations'
    # warpgroup give theirs down to 40, the converter to what it needs (split_tile holds 16 inputs, their digits and
    # addresses), and the compute warpgroups take what is left. (A 5-warpgroup trial asked for more than
    # the launch gave and never finished.)
    launch = 65536 // (128 * warpgroups) // 8 * 8
    converter_registers = 128 if parts else 72
    compute_registers = min(232, (launch * warpgroups - 40 * (1 + x_warpgroup) - converter_registers * convert) // 2
                            // 8 * 8)
    names = tuple(name for name in ORDER if name != "attn" or "no-attn" not in trials)
    new_token = full and "no-new" not in trials  # the step's own K/V: written to its page, folded into attention
    fold, write = new_token and "no-fold" not in trials, writes_new_token(numerics, attention, trials)
    phases = plan(cfg, programs, split, names)
    short = [ph for ph in phases if ph.name == "w_gate_up" and ph.units // programs < ph.steps]
    if numerics and short:
        raise ValueError(f"numerics sums a row's squares over a program's first {short[0].steps} gate_up units: runs "
                         f"of {short[0].units // programs} units at {programs} programs are shorter")
    group = cfg.num_heads // cfg.num_kv_heads
    widths = [next(ph.n for ph in phases if ph.out == out) for out in range(len(names))]  # each phase's outputs
    tiles_of = [cfg.num_heads if name == "attn" else w // BLOCK_N for name, w in zip(names, widths)]
    offsets = [sum(tiles_of[:out]) for out in range(len(names))]  # of each phase's tiles in a layer's counts
    per_layer_tiles = sum(tiles_of)
    count, last = len(phases), len(names) - 1  # blocks; the last phase

    def run_of(j, p, att_units):  # att_units: a head's units of attention (real: from the step's length)
        ph = phases[j]
        if ph.stream_k:
            v = lax.rem(p + ph.rotate, programs)
            return lax.div(v * ph.units, programs), lax.div((v + 1) * ph.units, programs)
        return jnp.minimum(p, ph.tiles) * att_units, jnp.minimum(p + 1, ph.tiles) * att_units

    def pieces(out, tile):  # the signals that complete a tile of phase out: two warpgroups a program holding a piece
        total = 0
        for ph in phases:
            if ph.out != out:
                continue
            if not ph.stream_k:
                return 2
            t = jnp.clip(tile - ph.tile0, 0, ph.tiles - 1)  # in the block, if it is one of the block's tiles
            first = qmm_gpu.stream_k_holder(t * ph.steps + 1, ph.units, programs)
            held = qmm_gpu.stream_k_holder((t + 1) * ph.steps, ph.units, programs) - first + 1
            if ph.units <= programs:  # a unit a program at most, and some programs none (the range would count them)
                held = ph.steps
            total = total + jnp.where((tile >= ph.tile0) & (tile < ph.tile0 + ph.tiles), 2 * held, 0)
        return total

    def sources(j, p, k_at):  # (phase, tile) whose pieces a unit of block j with inputs at k_at waits for
        name, out = phases[j].name, phases[j].out
        if name == "wqkv":  # the down tiles of the layer before
            return [(last, lax.div(k_at, BLOCK_N) + i) for i in range(BLOCK_K // BLOCK_N)]
        if name == "attn":  # head p: its q tile, its kv head's k and v tiles
            return [(out - 1, tile) for tile in qkv_tiles(cfg, p)]
        if name == "w_down":  # gate and up of its channels, interleaved by 128
            return [(out - 1, 2 * lax.div(k_at, BLOCK_N) + i) for i in range(2 * BLOCK_K // BLOCK_N)]
        return [(out - 1, lax.div(k_at, BLOCK_N) + i) for i in range(BLOCK_K // BLOCK_N)]

    def k_of(j, u):  # the first input of block j's unit u
        ph = phases[j]
        return (ph.step0 + lax.rem(u, ph.steps)) * BLOCK_K if ph.stream_k else 0

    def body(*refs):
        at = iter(refs)

        def take(n):
            return [next(at) for _ in range(n)]

        if per_layer_refs:  # each product's layers' arrays; K's and V's
            w_refs = [take(layers) for _ in PRODUCTS]
            kv_refs = [take(layers) for _ in range(2 if real_attention else 1)]
        else:
            w_refs, kv_refs = take(4), take(2 if real_attention else 1)
        b_refs = [] if convert else take(last + 1)  # the stand-in products' B (with `convert`: the sums, none)
        (g_ref,) = take(1)
        s_refs = dict(zip(PRODUCTS, take(4)))
        cs_ref, x0_ref, table_ref, len_ref = take(4)
        o_refs, (sqg_ref,) = take(last + 1), take(1)
        (ring, x_smem, o_smem, z_smem, tile_bar, free_bar, xs_smem, stage_bar, e_smem, raw_smem, g_smem,
         sq_smem, sc_smem, sc_bar, q_smem, p_smem, ao_smem, res_smem, res_bar, att_bar, rs_smem, knew_smem,
         vnew_smem, fold_smem, kv_bar, fold_bar) = list(at)
        kv_ref = kv_refs[0]  # the stand-in's K/V bytes, or (real) the K pages; kv_refs[1] the V pages
        w_smem, k_view, v_view = ring if real_attention else (ring, None, None)  # (views of the same slots)
        p, wg = lax.axis_index("p"), lax.axis_index("wg")
        # The counts are never taken back (taking back 368 a layer one atomic at a time, by one program at the end,
        # cost ~130 us a layer in a first run): call c waits for (c + 1) times a tile's pieces. `calls`
        # counts the calls; every warpgroup reads it at its start, and program 0 adds one only once every compute
        # warpgroup has departed (which each does after its producer's last wait), so no read sees the next call's.
        done = pl.get_global(plgpu.SemaphoreType.REGULAR((layers * per_layer_tiles,)))
        zeroed = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        departed = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        calls = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        # (full) a layer's qkv squares reduce-added by each program holding a unit of qkv's tile 0 (which are every
        # input step once), counted here
        squared = pl.get_global(plgpu.SemaphoreType.REGULAR((layers,)))
        epoch = pl.semaphore_read(calls) + 1
        length = len_ref[0] if real_attention else CONTEXT  # the positions in the cache (the new token's is next)
        blocks = lax.div(length + BLOCK_N - 1, BLOCK_N)  # K (and V) blocks of 128 positions a head reads
        att_units = 2 * blocks if real_attention else next((ph.steps for ph in phases if ph.name == "attn"), 0)
        runs = [run_of(j, p, att_units) for j in range(count)]
        holders = lax.div(pieces(0, 0), 2)  # programs holding a unit of qkv's tile 0
        bases, base = [], 0
        for begin, end in runs:
            bases.append(base)
            base = base + end - begin
        per_layer = base  # ring steps of one layer, for this program
        weight_of = dict(zip(PRODUCTS, w_refs))

        def with_layer(layer, arrays, fn):  # fn(array, its first layer): the one array of every layer (0), or
            # (per-layer) the layer's own array (layer), chosen by a binary tree of branches
            if not per_layer_refs:
                return fn(arrays, 0)

            def tree(lo, hi):
                if hi - lo == 1:
                    return fn(arrays[lo], layer)
                mid = (lo + hi) // 2
                pl.when(layer < mid)(lambda: tree(lo, mid))
                pl.when(layer >= mid)(lambda: tree(mid, hi))
            tree(0, layers)

        def position(layer, j, u):  # (ring step, slot) of phase j's unit u
            g = layer * per_layer + bases[j] + u - runs[j][0]
            return g, lax.rem(g, stages)

        def inputs_of(layer, j, u):  # (phase, layer, first column, columns) of the sums block j's unit u reads
            ph = phases[j]
            k_at = k_of(j, u)
            # the phase before's sums (qkv: the layer before's down; layer 0 reads the last layer's, a stand-in)
            src_j = ph.out - 1 if ph.out else last
            src_layer = layer if ph.out else jnp.where(layer > 0, layer - 1, layers - 1)
            width = 2 * BLOCK_K if ph.name == "w_down" else BLOCK_K  # down: its inputs' gate and up sums
            col = 2 * k_at if ph.name == "w_down" else (qkv_tiles(cfg, p)[0] * BLOCK_N if not ph.stream_k else k_at)
            return src_j, src_layer, col, width

        def copy_layer_input(layer, cols, dst, barrier):  # the layer's input [out_rows, cols]: the step's x0 for
            # layer 0, the layer before's down sums (h2) for the others
            pl.when(layer == 0)(lambda: plgpu.copy_gmem_to_smem(x0_ref.at[pl.ds(0, out_rows), cols], dst, barrier))
            below = o_refs[last].at[jnp.maximum(layer - 1, 0), pl.ds(0, out_rows), cols]
            pl.when(layer > 0)(lambda: plgpu.copy_gmem_to_smem(below, dst, barrier))

        def count_of(src_layer, src_j, tile):  # (semaphore, count this call waits for) of a tile's pieces
            wanted = epoch - 1 if "stale-deps" in trials else epoch  # stale: counts reached last call
            return done.at[src_layer * per_layer_tiles + offsets[src_j] + tile], wanted * pieces(src_j, tile)

        def wait_inputs(layer, j, u):  # until every piece of the tiles holding unit u's inputs is counted
            ph = phases[j]
            begin = runs[j][0]
            k_at = k_of(j, u)
            first_sight = (u - begin < ph.steps) if ph.stream_k else (u == begin)

            @pl.when(first_sight & ((layer > 0) | (ph.out > 0)) & ("no-deps" not in trials))
            def _():
                src_layer = layer - 1 if ph.out == 0 else layer
                waits = [count_of(src_layer, src_j, tile) for src_j, tile in sources(j, p, k_at)]
                if "poll-all" in trials:  # every count read at once, again until all are reached
                    def short(_):
                        return functools.reduce(jnp.logical_or, [pl.semaphore_read(s) < n for s, n in waits])

                    lax.while_loop(lambda c: c, short, jnp.bool_(True))
                    return
                for s, n in waits:
                    plgpu.semaphore_wait(s, n, decrement=False, memory_scope="gpu")

        def copy_x(layer, j, u):
            if x_load:  # the converter waits and loads
                return
            wait_inputs(layer, j, u)
            _, slot = position(layer, j, u)
            if not convert:
                plgpu.copy_gmem_to_smem(b_refs[phases[j].out].at[:, pl.ds(k_of(j, u), BLOCK_K)], x_smem.at[slot],
                                        tile_bar.at[slot])
                return
            src_j, src_layer, col, width = inputs_of(layer, j, u)
            if real_attention and phases[j].name == "attn":  # the head's q sums and each row's cos | sin, once
                @pl.when(u == runs[j][0])
                def _():
                    plgpu.copy_gmem_to_smem(
                        o_refs[src_j].at[src_layer, pl.ds(0, out_rows), pl.ds(col, cfg.head_dim)],
                        xs_smem.at[slot, pl.ds(0, out_rows), pl.ds(0, cfg.head_dim)], stage_bar.at[slot])
                    plgpu.copy_gmem_to_smem(cs_ref.at[pl.ds(0, out_rows)],
                                            xs_smem.at[slot, pl.ds(0, out_rows), pl.ds(BLOCK_K, cfg.head_dim)],
                                            stage_bar.at[slot])
                    if full:  # its kv head's k and v sums beside q and cos | sin, and the layer input's squares
                        for at, tile in zip((cfg.head_dim, BLOCK_K + cfg.head_dim), qkv_tiles(cfg, p)[1:]):
                            plgpu.copy_gmem_to_smem(
                                o_refs[src_j].at[src_layer, pl.ds(0, out_rows), pl.ds(tile * BLOCK_N, cfg.head_dim)],
                                xs_smem.at[slot, pl.ds(0, out_rows), pl.ds(at, cfg.head_dim)], att_bar)
                        if "no-deps" not in trials:
                            plgpu.semaphore_wait(squared.at[layer], epoch * holders, decrement=False,
                                                 memory_scope="gpu")
                        plgpu.copy_gmem_to_smem(sqg_ref.at[layer, pl.ds(0, rs_smem.shape[0])], rs_smem, att_bar)
                return
            def stage(at, w):  # sums [out_rows, w] from column col + at into the staging's columns at
                dst = xs_smem.at[slot, pl.ds(0, out_rows), pl.ds(at, w)]
                if phases[j].out == 0:  # qkv reads the layer's input
                    return copy_layer_input(layer, pl.ds(col + at, w), dst, stage_bar.at[slot])
                plgpu.copy_gmem_to_smem(o_refs[src_j].at[src_layer, pl.ds(0, out_rows), pl.ds(col + at, w)], dst,
                                        stage_bar.at[slot])

            if numerics and phases[j].name in NORMED and "no-gain" not in trials:  # the sums, and the gain beside
                stage(0, width)
                plgpu.copy_gmem_to_smem(g_ref.at[layer, NORMED.index(phases[j].name), pl.ds(k_of(j, u), BLOCK_K)],
                                        g_smem.at[slot], stage_bar.at[slot])
                return
            for half in range(2):  # (a copy moves at most 256 along a dimension)
                stage(half * width // 2, width // 2)

        def each_unit(work):  # work(layer, block, unit, slot) for this program's units, each once its slot is free
            def unit(layer, j, u):
                g, slot = position(layer, j, u)

                @pl.when(g >= stages)  # the compute warpgroups are done with the slot's activations
                def _():
                    plgpu.barrier_wait(free_bar.at[slot])

                work(layer, j, u, slot)

            def layer_body(layer, carry):
                for j in range(count):
                    lax.fori_loop(runs[j][0], runs[j][1], lambda u, c, j=j: (unit(layer, j, u), c)[1], None)
                return carry

            lax.fori_loop(0, layers, layer_body, None)

        @pl.when(wg == 3)
        def _converter():
            if not convert:
                return
            plgpu.set_max_registers(converter_registers,
                                    action="increase" if converter_registers > launch else "decrease")
            if full:  # its reduce-adds of squares land after every program's zeroes
                plgpu.semaphore_wait(zeroed, epoch * programs, decrement=False, memory_scope="gpu")

            def unit(layer, j, u, slot):
                if real_attention and phases[j].name == "attn":  # q, rotated, in bfloat16 (once a head)
                    @pl.when(u == runs[j][0])
                    def _():
                        plgpu.barrier_wait(stage_bar.at[slot])
                        half = cfg.head_dim // 2

                        def staged(at):
                            return _load_t(xs_smem.at[slot, :, pl.ds(at, half)])
                        lo, hi = staged(0), staged(half)
                        cos, sin = staged(BLOCK_K), staged(BLOCK_K + half)

                        def rotated(lo, hi):
                            return lo * cos - hi * sin, hi * cos + lo * sin

                        made, later = [(q_smem.at[pl.ds(0, COLS)], rotated(lo, hi))], []
                        if full:  # q, k and v times the attention norm's 1/rms (a number a row); k rotated too
                            plgpu.barrier_wait(att_bar)
                            sq = backend_lib.gpu_load(rs_smem.at[pl.ds(0, COLS)], layout=plgpu.Layout.WGMMA.reduce(0))
                            inv = lax.broadcast_in_dim(lax.rsqrt(sq * (1.0 / cfg.hidden_size) + eps), lo.shape, [1])
                            hd = cfg.head_dim

                            def bf16(halves):  # bfloat16's values (the cache's), in float32
                                return [a.astype(jnp.bfloat16).astype(jnp.float32) for a in halves]
                            q = bf16(rotated(lo * inv, hi * inv))
                            k = bf16(rotated(staged(hd) * inv, staged(hd + half) * inv))
                            v = bf16((staged(BLOCK_K + hd) * inv, staged(BLOCK_K + hd + half) * inv))
                            # q first, published alone: attention's first block waits for it, the rest not
                            made = [(q_smem.at[pl.ds(0, COLS)], q)]
                            later = [(knew_smem, k), (vnew_smem, v)]
                            if fold:  # for attention's fold, q, k and v in float32 (a first fold
                                # summed q·k here, across the warps: that run never finished; wg0 sums it)
                                later += [(fold_smem.at[i, pl.ds(0, COLS)], a) for i, a in enumerate((q, k, v))]

                        def store(made):
                            for ref, halves in made:
                                for at, val in zip((0, half), halves):
                                    qmm_gpu.store_transposed(val, ref.at[:, pl.ds(at, half)], interpreted=False)
                            plgpu.commit_smem()
                        store(made)
                        plgpu.barrier_arrive(tile_bar.at[slot])
                        if later:  # (publishing q with these made every block wait for the fold's)
                            store(later)
                        if fold:
                            plgpu.barrier_arrive(fold_bar)  # wg0's fold waits for it after the cached blocks

                    @pl.when(u != runs[j][0])
                    def _():
                        plgpu.barrier_arrive(tile_bar.at[slot])
                    if write:
                        @pl.when((u == runs[j][1] - 1) & (lax.rem(p, group) == 0))
                        def _():  # the group's first head writes the new token's K and V into the next position,
                            # once its last unit is handed over (writing at the first, before the rest's, was slower)
                            entry = jnp.minimum(lax.div(length, page_size), table_ref.shape[0] - 1)
                            page = jnp.clip(table_ref[entry], 0, pool - 1)
                            for src, pages in zip((knew_smem, vnew_smem), kv_refs):
                                def write_row(pages, first, src=src):
                                    row = (((layer - first) * cfg.num_kv_heads + lax.div(p, group)) * pool + page
                                           ) * page_size + lax.rem(length, page_size)
                                    plgpu.copy_smem_to_gmem(src.at[pl.ds(0, 1)], pages.at[pl.ds(row, 1)])
                                with_layer(layer, pages, write_row)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (all awaited at the end)
                    return
                if x_load:  # the sums by this warpgroup's own (coalesced) loads, a row at a time, into the staging
                    wait_inputs(layer, j, u)
                    src_j, src_layer, col, width = inputs_of(layer, j, u)
                    for r in range(out_rows):
                        row = backend_lib.gpu_load(o_refs[src_j].at[src_layer, r, pl.ds(col, width)],
                                                   layout=plgpu.Layout.WG_STRIDED((width,), vec_size=width // 128))
                        xs_smem.at[slot, r, pl.ds(0, width)][...] = row
                    plgpu.commit_smem()  # (a warpgroup barrier: every thread's row before any reads them)
                else:
                    plgpu.barrier_wait(stage_bar.at[slot])

                def sums(at):
                    return xs_smem.at[slot, :, pl.ds(at, qmm_gpu.ROWS)]
                if parts and phases[j].name != "w_down":  # the staged sums are the activations: split in place
                    if numerics and j == 0:
                        @pl.when(u == runs[0][0])
                        def _():  # a layer's first unit: its MLP's (and with `full` its qkv's) sums of squares start
                            # from zero
                            zeros = plgpu.layout_cast(jnp.zeros((128,), jnp.float32),
                                                      plgpu.Layout.WG_STRIDED((128,), vec_size=1))
                            sq_smem.at[lax.rem(layer, 2)][...] = zeros
                            if full:
                                sq_smem.at[3][...] = zeros
                            plgpu.commit_smem()  # (a warpgroup barrier: zero before this unit's split adds)
                    if "no-split" not in trials:
                        normed = numerics and phases[j].name in NORMED and "no-gain" not in trials
                        # gate_up: the first `steps` units of a run hold each of the 16 input steps once (a run is
                        # longer), so their squares make the row's whole sum; the others' go to an unread row
                        first_sight = (u - runs[j][0] < phases[j].steps) & (phases[j].name == "w_gate_up")
                        row = jnp.where(first_sight, lax.rem(layer, 2), 2)
                        if full and j == 0:  # qkv's tile 0 holds each input step once: its squares are the row's
                            row = jnp.where(u < phases[0].steps, 3, 2)
                        squares = sq_smem.at[row]
                        split_tile(xs_smem.at[slot], x_smem.at[slot], e_smem.at[slot], parts=PARTS,
                                   inputs=split_inputs, rows=out_rows,
                                   **({"gain": g_smem.at[slot], "squares": squares} if normed else {}))
                    plgpu.commit_smem()  # visible to the tensor cores before the compute warpgroups hear of it
                    plgpu.barrier_arrive(tile_bar.at[slot])
                    if full and j == 0:
                        @pl.when(u == jnp.minimum(runs[0][1], phases[0].steps) - 1)
                        def _():  # this program's last unit of qkv's tile 0: its squares into the layer's, counted
                            plgpu.copy_smem_to_gmem(sq_smem.at[3], sqg_ref.at[layer], reduction_op="add")
                            plgpu.wait_smem_to_gmem(0)
                            plgpu.semaphore_signal(squared.at[layer], 1, memory_scope="gpu")
                    return
                for c in range(BLOCK_K // qmm_gpu.ROWS):
                    if phases[j].name == "w_down":  # gate and up interleaved by 128 channels
                        at = c // 2 * 2 * BLOCK_N + c % 2 * qmm_gpu.ROWS
                        gate = _load_t(sums(at))
                        up = _load_t(sums(at + BLOCK_N))
                        if numerics:  # both times the mlp norm's 1/rms, a number a row
                            sq = backend_lib.gpu_load(sq_smem.at[lax.rem(layer, 2), pl.ds(0, COLS)],
                                                      layout=plgpu.Layout.WGMMA.reduce(0))
                            inv = lax.broadcast_in_dim(lax.rsqrt(sq * (1.0 / cfg.hidden_size) + eps),
                                                       gate.shape, [1])
                            gate, up = gate * inv, up * inv
                        v = gate / (1.0 + jnp.exp(-gate)) * up
                    else:
                        v = _load_t(sums(c * qmm_gpu.ROWS))
                    if parts:  # the float32 activations, to be split
                        qmm_gpu.store_transposed(v, raw_smem.at[:, pl.ds(c * qmm_gpu.ROWS, qmm_gpu.ROWS)],
                                                 interpreted=False)
                        continue
                    qmm_gpu.store_transposed(v * qmm_gpu.X_SHIFT, x_smem.at[slot, :, pl.ds(c * qmm_gpu.ROWS,
                                                                                          qmm_gpu.ROWS)],
                                             interpreted=False)
                if parts and "no-split" not in trials:
                    plgpu.commit_smem()  # (a warpgroup barrier: every thread's activations before the split reads them)
                    split_tile(raw_smem, x_smem.at[slot], e_smem.at[slot], parts=PARTS, inputs=split_inputs,
                               rows=out_rows)
                plgpu.commit_smem()  # visible to the tensor cores before the compute warpgroups hear of it
                plgpu.barrier_arrive(tile_bar.at[slot])

            each_unit(unit)
            plgpu.wait_smem_to_gmem(0)  # the new tokens' K/V writes have landed

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def with_weight(layer, j, u, fn):  # fn(phase j's unit u's weights (attention: its K or V) in global
                # memory)
                ph = phases[j]

                def src(array, first):
                    if ph.stream_k:
                        tile = (layer - first) * (ph.n // BLOCK_N) + ph.tile0 + lax.div(u, ph.steps)
                        if weight_tiles:  # [128, 256] tiles, a tile's inputs in steps: 32 KB of contiguous bytes
                            step = ph.step0 + lax.rem(u, ph.steps)
                            return fn(array.at[pl.ds((tile * (ph.k // BLOCK_K) + step) * BLOCK_N, BLOCK_N)])
                        return fn(array.at[pl.ds(tile * BLOCK_N, BLOCK_N), pl.ds(k_of(j, u), BLOCK_K)])
                    kv_head = lax.div(p, group)
                    return fn(array.at[pl.ds((((layer - first) * cfg.num_kv_heads + kv_head) * ph.steps
                                              + lax.rem(u, ph.steps)) * BLOCK_N, BLOCK_N)])
                with_layer(layer, weight_of[ph.name] if ph.stream_k else kv_ref, src)

            def prefetch_step(g):  # the weights of this program's ring step g (if in this call) into L2
                layer, r = lax.div(g, per_layer), lax.rem(g, per_layer)
                for jj in range(count):
                    if real_attention and phases[jj].name == "attn":  # (the pages: not prefetched)
                        continue
                    lo, hi = bases[jj], bases[jj] + runs[jj][1] - runs[jj][0]

                    @pl.when((layer < layers) & (r >= lo) & (r < hi))
                    def _(jj=jj, lo=lo):
                        with_weight(layer, jj, runs[jj][0] + r - lo, plgpu.async_prefetch)

            def copy_weight(layer, j, u):
                g, slot = position(layer, j, u)
                attention_unit = real_attention and phases[j].name == "attn"
                if attention_unit:  # the pages' table entries read before the slot's wait, not after it (session
                    # 30: after, each block's 8 reads of global memory were on attention's path)
                    blk, is_k = lax.div(u - runs[j][0], 2), lax.rem(u - runs[j][0], 2) == 0
                    base = lax.div(p, group) * pool  # (the layer's own array: per-layer)
                    if not per_layer_refs:
                        base = base + layer * cfg.num_kv_heads * pool
                    per_block = BLOCK_N // page_size
                    firsts = [(base + jnp.clip(table_ref[jnp.minimum(blk * per_block + i, table_ref.shape[0] - 1)],
                                               0, pool - 1)) * page_size for i in range(per_block)]  # (past the
                    # length: any page)

                @pl.when(g >= stages)
                def _():
                    plgpu.barrier_wait(free_bar.at[slot])

                if attention_unit:  # K, V, K, V, ... blocks, a page at a time, into the slot's bfloat16 views, on
                    # kv_bar; tile_bar's arrivals are this one and the converter's

                    def copy_pages(pages, view):
                        for i, first in enumerate(firsts):
                            plgpu.copy_gmem_to_smem(pages.at[pl.ds(first, page_size)],
                                                    view.at[slot, pl.ds(i * page_size, page_size)], kv_bar.at[slot])

                    pl.when(is_k)(lambda: with_layer(layer, kv_refs[0], lambda a, _: copy_pages(a, k_view)))
                    pl.when(~is_k)(lambda: with_layer(layer, kv_refs[1], lambda a, _: copy_pages(a, v_view)))
                    plgpu.barrier_arrive(tile_bar.at[slot])
                else:
                    with_weight(layer, j, u, lambda src: plgpu.copy_gmem_to_smem(src, w_smem.at[slot],
                                                                                 tile_bar.at[slot]))
                if prefetch:
                    prefetch_step(g + prefetch)

            def ahead_of(j):  # the units of phase j whose weights went out before its first activations
                begin, end = runs[j]
                return jnp.minimum(begin + stages, end)

            def issue_ahead(layer, j):
                lax.fori_loop(runs[j][0], ahead_of(j), lambda u, c: (copy_weight(layer, j, u), c)[1], None)

            issue_ahead(0, 0)

            def layer_body(layer, carry):
                for j in range(count):
                    begin, end = runs[j]
                    if not x_warpgroup:
                        lax.fori_loop(begin, ahead_of(j), lambda u, c, j=j: (copy_x(layer, j, u), c)[1], None)

                    def step(u, c, j=j):
                        copy_weight(layer, j, u)
                        if not x_warpgroup:
                            copy_x(layer, j, u)
                        return c

                    lax.fori_loop(ahead_of(j), end, step, None)
                    if j + 1 < count:
                        issue_ahead(layer, j + 1)
                    else:
                        pl.when(layer + 1 < layers)(lambda: issue_ahead(layer + 1, 0))
                return carry

            lax.fori_loop(0, layers, layer_body, None)
            total = layers * per_layer
            qmm_gpu.drain(free_bar, stages, jnp.maximum(total - stages, 0), total)

        @pl.when((wg == x_wg) & x_warpgroup)
        def _activations():  # x-warpgroup: the activations' waits and copies, apart from the weights'
            plgpu.set_max_registers(40, action="decrease")
            each_unit(lambda layer, j, u, slot: copy_x(layer, j, u))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(compute_registers, action="increase")
            rows = pl.ds(pl.multiple_of(wg * qmm_gpu.ROWS, qmm_gpu.ROWS), qmm_gpu.ROWS)

            @pl.when(wg == 0)
            def _zero():  # this program's share of every reduce-added output, then counted
                z_smem[...] = plgpu.layout_cast(jnp.zeros(z_smem.shape, jnp.float32),  # (made here: an input of
                                                plgpu.Layout.WG_STRIDED(z_smem.shape, vec_size=4))  # zeros was a
                plgpu.commit_smem()  # launch a step to fill), visible to the copies below
                for out, (name, n) in enumerate(zip(names, widths)):
                    if name == "attn":
                        continue
                    chunks = layers * (n // qmm_gpu.ROWS)

                    def zero(i, c, out=out, n=n):
                        chunk = p + i * programs
                        col = pl.ds(lax.rem(chunk, n // qmm_gpu.ROWS) * qmm_gpu.ROWS, qmm_gpu.ROWS)
                        plgpu.copy_smem_to_gmem(z_smem.at[pl.ds(0, out_rows)],
                                                o_refs[out].at[lax.div(chunk, n // qmm_gpu.ROWS),
                                                               pl.ds(0, out_rows), col])
                        return c

                    lax.fori_loop(0, lax.div(chunks - p + programs - 1, programs), zero, None)
                if full:  # the layers' squares (layer p, p + programs, ...)
                    def zero_squares(i, c):
                        for at in range(0, sqg_ref.shape[1], qmm_gpu.ROWS):
                            plgpu.copy_smem_to_gmem(z_smem.at[0], sqg_ref.at[p + i * programs, pl.ds(at, qmm_gpu.ROWS)])
                        return c

                    lax.fori_loop(0, lax.div(layers - p + programs - 1, programs), zero_squares, None)
                plgpu.wait_smem_to_gmem(0)
                plgpu.semaphore_signal(zeroed, 1, memory_scope="gpu")

            plgpu.semaphore_wait(zeroed, epoch * programs, decrement=False, memory_scope="gpu")

            def attend(layer, j, begin, g0):  # real attention: a head's units, K, V, K, V, ..., by warpgroup 0
                def slot_of(u):
                    return lax.rem(g0 + u - begin, stages)

                def finish(m, denom, acc):  # the fold (with the new token), then the head's output stored
                    halves = [acc[at:at + qmm_gpu.ROWS] for at in range(0, cfg.head_dim, qmm_gpu.ROWS)]
                    c = cfg.head_dim ** -0.5 * LOG2E
                    if fold:  # the step's own K/V: one key more. Its score q·k by elementwise products and one sum
                        # across the warpgroup, then the online softmax's update for one key (the fold, a
                        # wgmma on a 64-key tile and the softmax of a block, cost ~3 us a layer)
                        plgpu.barrier_wait(fold_bar)

                        def folded(i, at):  # the converter's [64, queries] half at `at` of q (0), k (1) or v (2)
                            return _load_t(fold_smem.at[i, :, pl.ds(at, qmm_gpu.ROWS)])
                        ats = range(0, cfg.head_dim, qmm_gpu.ROWS)
                        q_k = [folded(0, at) * folded(1, at) for at in ats]
                        score = jnp.sum(functools.reduce(jnp.add, q_k), axis=0) * c  # [queries]
                        m_new = jnp.maximum(m, score)
                        alpha, p_new = jnp.exp2(m - m_new), jnp.exp2(score - m_new)
                        denom = denom * alpha + p_new
                        halves = [h * lax.broadcast_in_dim(alpha, h.shape, [1])
                                  + folded(2, at) * lax.broadcast_in_dim(p_new, h.shape, [1])
                                  for at, h in zip(ats, halves)]
                    denom = jnp.where(denom == 0.0, 1.0, denom)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for at, h in zip(range(0, cfg.head_dim, qmm_gpu.ROWS), halves):
                        qmm_gpu.store_transposed(h / lax.broadcast_in_dim(denom, h.shape, [1]),
                                                 ao_smem.at[:, pl.ds(at, qmm_gpu.ROWS)], interpreted=False)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(ao_smem.at[pl.ds(0, out_rows)],
                                            o_refs[phases[j].out].at[layer, pl.ds(0, out_rows),
                                                                     pl.ds(p * cfg.head_dim, cfg.head_dim)])
                    plgpu.wait_smem_to_gmem(0)

                @pl.when(wg == 0)
                def _():
                    col_vec = functools.partial(with_layout, layout=plgpu.Layout.WGMMA.reduce(0), interpreted=False)
                    queries = q_smem.shape[0]
                    m = col_vec(jnp.full((queries,), -1e30, jnp.float32))
                    denom = col_vec(jnp.zeros((queries,), jnp.float32))
                    acc = with_layout(jnp.zeros((cfg.head_dim, queries), jnp.float32), plgpu.Layout.WGMMA,
                                      interpreted=False)
                    key = with_layout(lax.broadcasted_iota(jnp.int32, (BLOCK_N, queries), 0), plgpu.Layout.WGMMA,
                                      interpreted=False)
                    c = cfg.head_dim ** -0.5 * LOG2E

                    def block(blk, carry):
                        m, denom, acc = carry
                        k_slot, v_slot = slot_of(begin + 2 * blk), slot_of(begin + 2 * blk + 1)
                        plgpu.barrier_wait(tile_bar.at[k_slot])
                        plgpu.barrier_wait(kv_bar.at[k_slot])
                        scores = mma_transposed(k_view.at[k_slot], q_smem, interpreted=False)  # [keys, queries]
                        plgpu.barrier_arrive(free_bar.at[k_slot])
                        scores = jnp.where(key + blk * BLOCK_N < length, scores, -jnp.inf)  # past the length: none
                        probs, m, denom, alpha = online_softmax(scores, m, denom, c, axis=0)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
                        plgpu.commit_smem()  # (a warpgroup barrier: every warp's part of the block before's Vᵀ·P
                        # wgmma, which reads all of P, is done before P is stored again)
                        p_smem[...] = probs.astype(p_smem.dtype)
                        plgpu.commit_smem()
                        plgpu.barrier_wait(tile_bar.at[v_slot])
                        plgpu.barrier_wait(kv_bar.at[v_slot])
                        short = length - blk * BLOCK_N  # positions in this block, if it is the last
                        pl.when(short < BLOCK_N)(functools.partial(  # V's rows past the length: stale, maybe NaN
                            zero_rows_from, v_view.at[v_slot], short, interpreted=False))
                        acc = mma_values_transposed(acc, v_view.at[v_slot], p_smem, interpreted=False)
                        plgpu.barrier_arrive(free_bar.at[v_slot])
                        return m, denom, acc

                    m, denom, acc = lax.fori_loop(0, blocks, block, (m, denom, acc))
                    finish(m, denom, acc)

                @pl.when(wg == 1)
                def _():  # the other compute warpgroup hands the slots back
                    def hand_back(i, c):
                        plgpu.barrier_wait(tile_bar.at[slot_of(begin + i)])
                        plgpu.barrier_arrive(free_bar.at[slot_of(begin + i)])
                        return c

                    lax.fori_loop(0, att_units, hand_back, None)

                plgpu.semaphore_signal(done.at[layer * per_layer_tiles + offsets[phases[j].out] + p], 1,
                                       memory_scope="gpu")

            def layer_body(layer, carry):
                for j, ph in enumerate(phases):
                    begin, end = runs[j]
                    g0 = layer * per_layer + bases[j]

                    def fragment(tile, j=j, ph=ph, begin=begin, end=end, g0=g0):
                        @pl.when((begin < end) & (tile <= lax.div(end - 1, ph.steps)))
                        def _():
                            start = jnp.maximum(begin, tile * ph.steps)
                            stop = jnp.minimum(end, (tile + 1) * ph.steps)
                            col0 = (ph.tile0 + tile) * BLOCK_N + wg * qmm_gpu.ROWS  # this warpgroup's 64 outputs
                            cols = pl.ds(col0, qmm_gpu.ROWS)
                            scaled = numerics and ph.stream_k and "no-scale" not in trials
                            if scaled:  # the rows' scales, copied in while the products run
                                plgpu.copy_gmem_to_smem(s_refs[ph.name].at[pl.ds(layer * ph.n + col0, qmm_gpu.ROWS)],
                                                        sc_smem.at[wg], sc_bar.at[wg])
                            # numerics: the piece holding a tile's first input step adds the residual stream (wo: the
                            # layer's input; down: wo's sums, h1), so wo's and down's sums are h1 and h2
                            residual = numerics and ph.name in ("wo", "w_down") and "no-residual" not in trials
                            first_piece = start == tile * ph.steps
                            if residual:
                                @pl.when(first_piece)
                                def _():
                                    dst = res_smem.at[wg, pl.ds(0, out_rows)]
                                    if ph.name == "w_down":  # (final: this program's first 16 gate_up units
                                        # waited for every wo tile)
                                        src = o_refs[names.index("wo")].at[layer, pl.ds(0, out_rows), cols]
                                        return plgpu.copy_gmem_to_smem(src, dst, res_bar.at[wg])
                                    if "no-deps" not in trials:  # past layer 0: the layer before's down tile, once
                                        # all its pieces are in (a program outside attention has waited only for its
                                        # qkv units' input tiles)
                                        pl.when(layer > 0)(lambda: plgpu.semaphore_wait(
                                            *count_of(layer - 1, last, ph.tile0 + tile), decrement=False,
                                            memory_scope="gpu"))
                                    copy_layer_input(layer, cols, dst, res_bar.at[wg])

                            if parts:
                                acc = ring_product_parts(w_smem, x_smem, e_smem, tile_bar, free_bar, rows, start,
                                                         stop, lambda u: lax.rem(g0 + u - begin, stages))
                            elif products == "float16":
                                acc = qmm_gpu.ring_product(w_smem, x_smem, tile_bar, free_bar, rows, start, stop,
                                                           lambda u: lax.rem(g0 + u - begin, stages),
                                                           interpreted=False)
                            else:
                                acc = s8_sums(w_smem, tile_bar, free_bar, rows, start, stop,
                                              lambda u: lax.rem(g0 + u - begin, stages),
                                              lambda slot, u, c: x_smem.at[slot, :, pl.ds(c, 128)])
                            acc = acc.astype(jnp.float32)
                            if scaled:
                                plgpu.barrier_wait(sc_bar.at[wg])
                                scale = backend_lib.gpu_load(sc_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                                acc = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
                            if residual:
                                def add_residual(a):
                                    plgpu.barrier_wait(res_bar.at[wg])
                                    return a + _load_t(res_smem.at[wg])

                                acc = lax.cond(first_piece, add_residual, lambda a: a, acc)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            qmm_gpu.store_transposed(acc, o_smem.at[wg], interpreted=False)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, out_rows)],
                                                    o_refs[ph.out].at[layer, pl.ds(0, out_rows), cols],
                                                    reduction_op="add" if ph.stream_k else None)
                            if "no-store-wait" not in trials:
                                plgpu.wait_smem_to_gmem(0)  # the piece is in global memory before it is counted
                            plgpu.semaphore_signal(done.at[layer * per_layer_tiles + offsets[ph.out] + ph.tile0 + tile], 1,
                                                   memory_scope="gpu")

                    if real_attention and ph.name == "attn":
                        pl.when(begin < end)(functools.partial(attend, layer, j, begin, g0))
                        continue
                    first_tile = lax.div(begin, ph.steps)
                    for f in range(ph.fragments):
                        fragment(first_tile + f)
                return carry

            lax.fori_loop(0, layers, layer_body, None)

            # every warpgroup departs; once all have, program 0 counts the call (see `calls` above)
            plgpu.semaphore_signal(departed, 1, memory_scope="gpu")

            @pl.when((p == 0) & (wg == 0))
            def _():
                plgpu.semaphore_wait(departed, 2 * programs, memory_scope="gpu")
                plgpu.semaphore_signal(calls, 1, memory_scope="gpu")

    int8_swizzle = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    ring_type = plgpu.SMEM((stages, BLOCK_N, BLOCK_K), jnp.int8, transforms=int8_swizzle)
    if real_attention:  # the same slots as bfloat16 K (128-byte swizzle) and V (32-byte swizzle, as P's) blocks
        ring_type = plgpu.RefUnion(ring_type,
                                   plgpu.SMEM((stages, BLOCK_N, cfg.head_dim), jnp.bfloat16,
                                              transforms=mma_transforms(jnp.bfloat16)),
                                   plgpu.SMEM((stages, BLOCK_N, cfg.head_dim), jnp.bfloat16, transforms=P_SWIZZLE))
    x_dtype = jnp.float16 if products == "float16" else jnp.int8
    x_transforms = mma_transforms(jnp.float16) if products == "float16" else int8_swizzle
    kernel = _kernel(
        body,
        out_type=(*(jax.ShapeDtypeStruct((layers, COLS, n), jnp.float32) for n in widths),
                  jax.ShapeDtypeStruct((layers, 128), jnp.float32)),  # each row's squares of qkv's inputs (full)
        scratch_types=(
            ring_type,
            plgpu.SMEM((stages, PARTS * COLS if parts else COLS, BLOCK_K), x_dtype, transforms=x_transforms),
            plgpu.SMEM((2, COLS, qmm_gpu.ROWS), jnp.float32),
            plgpu.SMEM((COLS, qmm_gpu.ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # a unit's weight tile and its activations
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups done with a slot
            plgpu.SMEM((stages if convert else 1, COLS, 2 * BLOCK_K if convert else 8), jnp.float32),  # staging
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # a unit's sums staged (two copies)
            plgpu.SMEM((stages if parts else 1, BLOCK_K // PART_INPUTS, unit_columns(COLS)), jnp.float32),  # units
            plgpu.SMEM((COLS, BLOCK_K if parts else 8), jnp.float32),  # the converter's activations, to be split
            plgpu.SMEM((stages if numerics else 1, BLOCK_K), jnp.float32),  # a unit's gains (numerics)
            plgpu.SMEM((4, 128), jnp.float32),  # each row's sum of squares: the MLP's by layer parity, an unread row,
            # qkv's tile 0's (full)
            plgpu.SMEM((2, qmm_gpu.ROWS), jnp.float32),  # each compute warpgroup's rows' scales (numerics)
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
            plgpu.SMEM((16, cfg.head_dim) if real_attention else (8, 64), jnp.bfloat16,  # q (real attention)
                       transforms=mma_transforms(jnp.bfloat16)),
            plgpu.SMEM((BLOCK_N, 16) if real_attention else (8, 16), jnp.bfloat16, transforms=P_SWIZZLE),  # P
            plgpu.SMEM((16, cfg.head_dim) if real_attention else (1, 32), jnp.float32),  # the head's output
            plgpu.SMEM((2, COLS, qmm_gpu.ROWS), jnp.float32),  # each compute warpgroup's residual (numerics)
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
            plgpu.Barrier(num_arrivals=3),  # (full) attention's k and v sums and the layer's squares
            plgpu.SMEM((32,), jnp.float32),  # the layer's squares, a number a row (full)
            plgpu.SMEM((COLS, cfg.head_dim) if full else (1, 64), jnp.bfloat16),  # the new token's k (full)
            plgpu.SMEM((COLS, cfg.head_dim) if full else (1, 64), jnp.bfloat16),  # and v
            plgpu.SMEM((3, 16, cfg.head_dim) if fold else (1, 1, 32), jnp.float32),  # q, k, v for the fold
            plgpu.Barrier(num_arrivals=max(1, BLOCK_N // page_size), num_barriers=stages),  # a K/V block's pages
            plgpu.Barrier(num_arrivals=1),  # the new token's key tile and v stored (the fold's)
        ),
        grid=(programs,), grid_names=("p",), num_threads=warpgroups, thread_name="wg",
        # Without Pallas's automatic warpgroup syncs (one before each TMA copy a thread issues, one before and one
        # after each store to shared memory): every hand-over of shared memory between a warpgroup's threads has a
        # sync of its own. Between warpgroups the hand-overs are mbarriers, which every thread arrives at after its
        # own reads and writes. Within one: a store and the reads of it by other threads, or by wgmma and TMA, are
        # separated by commit_smem (a fence and a warpgroup sync); a store over what other threads or a wgmma read
        # before comes after one too (raw_smem: the split's commit; o_smem and ao_smem: wait_smem_to_gmem, which
        # syncs; P: the commit before it; the scales' and residual's copies: the fragment before's commit), and
        # semaphore_wait ends in a warpgroup sync before a copy that depends on it. split_tile's threads share
        # nothing across warps. "auto-barriers" puts Pallas's syncs back (the kernel before its syncs were dropped): the 8 syncs a
        # K/V block at 16-position pages were most of what those pages cost.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers="auto-barriers" not in trials),
    )
    return kernel, phases


def decode_layers(cfg, st, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                  lengths: jax.Array, inv_freq: np.ndarray, page_size: int, *, programs: int | None = None,
                  trial: str = "") -> tuple[jax.Array, jax.Array, jax.Array]:
    """reference.decode_layers in one kernel, for one row: x [1, d] (the new token, embedded), st the stacked int8
    layers (reference.stack_layers), K and V pages stacked (reference.stack_pages, bfloat16) of page_size positions,
    page_table [1, pages] int32, lengths [1] int32 (positions cached, at least 1; the new token's is next and its
    page must be in the table), inv_freq the rotary frequencies [head_dim / 2] -> (h [1, d] float32, the layers'
    output before the final norm; k_pages; v_pages with the new K/V written in place).
    `trial`: one of megakernel's trials that keep the outputs right, for benchmarks (e.g. "auto-barriers").
    Raises ValueError naming what the kernel does not take."""
    layers = st.gains.shape[0]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    programs = programs or backend_lib.num_sms()
    check_config(cfg, page_size, k_pages.dtype, programs)
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
    pool = k_pages.shape[0] // (layers * kvh * page_size)
    weight_tiles = st.values[0].ndim == 3  # (stack_layers' tiles; 2-D: row-major, its tiles=False)
    kernel, phases = megakernel(cfg, layers, programs, stages=2, out_rows=1, trial=trial, products="s8", convert=True,
                                numerics=True, attention="real", page_size=page_size, pool=pool,
                                eps=cfg.rms_norm_eps, weight_tiles=weight_tiles)
    angles = lengths[0].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # RoPE at the new position
    cos_sin = jnp.broadcast_to(jnp.concatenate([jnp.cos(angles), jnp.sin(angles)]), (COLS, hd))
    x0 = jnp.pad(x.astype(jnp.float32), ((0, COLS - 1), (0, 0)))
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)  # written in place: the new token's K and V
    outs = kernel(*(v.reshape(-1, v.shape[-1]) for v in st.values), k_ref, v_ref, st.gains,
                  *st.scales, cos_sin, x0, page_table[0].astype(jnp.int32), lengths.astype(jnp.int32))
    h = outs[len(ORDER) - 1][layers - 1, :1]  # the last layer's down sums with the residual: h2
    return h, jax.freeze(k_ref), jax.freeze(v_ref)
