"""The performance skeleton of a decode megakernel: every layer of an int8 decode step, attention included, in one
persistent Mosaic GPU kernel, with the phase boundaries the real kernel would have; what it would cost on the H100.

Session 26 (int8_gpu_notes.md) left 1.8x bfloat16 at batch 1 to a kernel that spans the layers with attention
inside it, at no more than session 22's skeleton (85 us a layer, every layer's four products in one kernel, grid
barriers between phases) with the numerics added. That skeleton had no attention (~9.5 us a layer of XLA and Pallas
kernels in the step today) and a grid barrier at each phase end (~2.3 us each). This one has the boundaries a
megakernel would have instead:

- phases qkv, attention, wo, gate_up, down of each layer in turn, on 132 programs (one an SM);
- a product phase is stream-K over (128-row tile, 256-input step) units through one copy ring that runs on
  across phases and layers; each piece of an output tile is added into the phase's float32 output in global
  memory by a TMA reduce-add (no owners, no gathers: the residual stream and the MLP's sums are summed where they
  land), then counted on the tile's grid-shared semaphore;
- a unit copies its 256 inputs only once every piece of the tiles holding them is counted (one hop between SMs a
  boundary, no grid barrier): qkv waits for two down tiles of the layer before, a head of attention for its q, k
  and v tiles, wo for two heads, gate_up for two wo tiles, down for the two gate and two up tiles of its inputs
  (gate_up's rows interleaved by 128 channels);
- attention: programs 0-31 take a head each, streaming its kv head's K and V (the stand-in: a context of 256 in
  4 units of 32 KB through the same ring, 1 MB a layer from HBM, the rest from L2; real: the step's length, from
  pages) and storing its [rows, 128] output;
- the float32 outputs are zeroed by the kernel at its start (every program a share, then a grid-wide count).

The products are int8 wgmma on a stand-in int8 B as in session 22's skeleton, or (`--products float16`) the served
kernels' step on a float16 stand-in, or (`--convert`) either on activations made from the phase before's sums
by a fourth warpgroup (s8: split into int8 parts). `--numerics` adds the norms, the scales and the residual
stream; `--attention real` a head's attention over K/V pages (RoPE, softmax); both together the new token's K/V
(written to its page, folded into the softmax) and q/k/v's 1/rms; `--check` compares every phase of the first
layers with numpy. Left to the served kernel: rows past one, real weights in the served layouts. Measured (H100,
32 layers, us a layer): 97.8 with float16 products and converted activations (session 27); 93.3-93.7 with s8
products on activations split into int8 parts (`--products s8 --convert --stages 2`, session 29); with
`--numerics` 94.5-94.7, with contiguous K/V and every numeric but the new token 95.6, paged at length 200 101.6
(session 30); every numeric, paged, length 256: 101.7 at 16 positions a page, 97.4 at 128 (session 31,
int8_gpu_notes.md).

Baseline in the same run and process: session 22's skeleton (the four products of each layer, grid barriers, no
attention) on the same weights. The bound for the served step: 32 · (this, a layer) + the head (~0.21 ms) against
bfloat16's ~5.86-5.96 ms (session 26); 1.8x needs at most ~95 us a layer here, with the numerics still to add.

    PYTHONPATH=. python3 benchmarks/megakernel_skeleton_gpu.py [--layers 8]   # results/megakernel_skeleton_gpu.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, decode_step, device_seconds, run_steps  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth_device  # noqa: E402
from benchmarks.layer_skeleton_gpu import PHASES, skeleton  # noqa: E402
from jaxserve.config import QuantConfig  # noqa: E402
from jaxserve.model.quant import quantize_weights  # noqa: E402
from jaxserve.model.weights import random_weights  # noqa: E402
from pallas_kernels import backend as backend_lib  # noqa: E402
from pallas_kernels.decode_megakernel.mosaic_gpu import (  # noqa: E402
    BLOCK_K,
    BLOCK_N,
    COLS,
    CONTEXT,
    NORMED,
    PRODUCTS,
    check_config,
    layer_products,
    megakernel,
    qkv_tiles,
    writes_new_token,
)

CHECKED_LAYERS = 4  # the layers --check compares (each a few seconds of float64 numpy)
SESSION = 32  # recorded with the results


class Inputs(NamedTuple):
    """The kernel's inputs, in its order once flattened (`flat`)."""
    weights: list  # int8 [layers · n, k] for each of PRODUCTS
    kv: list  # the stand-in attention's K/V bytes; real: the K and V pages [layers · kv heads · pool · page, hd]
    bs: list  # each phase's stand-in B (none with `convert`: the activations are the sums)
    gains: jax.Array  # [layers, len(NORMED), d] float32 (numerics)
    scales: list  # float32 [layers · n] for each of PRODUCTS (numerics)
    cos_sin: jax.Array  # each row's RoPE cos | sin [COLS, head_dim] (real attention)
    x0: jax.Array  # the step's input [COLS, d], what layer 0's qkv reads (with `convert`)
    table: jax.Array  # the sequence's pages [pages] int32 (real attention)
    length: jax.Array  # [1] int32: its positions in the cache (real attention; the new token's is next)

    def flat(self, per_layer: bool = False) -> list:
        """(per_layer: each weight and pool as `layers` arrays of their own, in layer order)"""
        if per_layer:
            layers = len(self.gains)
            return [*(part for a in [*self.weights, *self.kv] for part in jnp.split(a, layers)), *self.bs,
                    self.gains, *self.scales, self.cos_sin, self.x0, self.table, self.length]
        return [*self.weights, *self.kv, *self.bs, self.gains, *self.scales, self.cos_sin, self.x0,
                self.table, self.length]


def inputs(cfg, layers: int, phases, key, products: str = "s8", attention: str = "stand-in", length: int = CONTEXT,
           page_size: int = 16, pool: int = 64, convert: bool = False) -> Inputs:
    shapes = layer_products(cfg)
    weights = [jax.random.randint(key, (layers * shapes[name][0], shapes[name][1]), -127, 128,
                                  jnp.int32).astype(jnp.int8) for name in PRODUCTS]
    kv_steps = next((ph.steps for ph in phases if ph.name == "attn"), 2 * CONTEXT // BLOCK_N)  # K/V blocks of a kv
    # head
    pages = -(-(length + 1) // page_size)  # the sequence's, with room for the new token: `pages` of the pool's
    table = jnp.asarray(np.random.RandomState(0).permutation(pool)[:pages], jnp.int32)
    if attention == "real":  # bfloat16 pages; K an eighth of V, so that the cached keys' scores are O(1) beside
        # q's ~8 an entry (else the softmax is an argmax, and --check blind to a key more or less)
        kv = [(jax.random.normal(k, (layers * cfg.num_kv_heads * pool * page_size, cfg.head_dim)) * size
               ).astype(jnp.bfloat16) for k, size in zip(jax.random.split(key), (0.125, 1.0))]
    else:  # the same bytes as int8, for the stand-in's products
        kv = [jax.random.randint(key, (layers * cfg.num_kv_heads * kv_steps * BLOCK_N, BLOCK_K), -127, 128,
                                 jnp.int32).astype(jnp.int8)]
    ks = [next(ph.k for ph in phases if ph.out == out) for out in range(phases[-1].out + 1)]  # each phase's inputs
    if convert:
        bs = []
    elif products == "float16":
        bs = [jax.random.normal(key, (COLS, k), jnp.float32).astype(jnp.float16) for k in ks]
    else:
        bs = [jax.random.randint(key, (COLS, k), -127, 128, jnp.int32).astype(jnp.int8) for k in ks]
    gains = jax.random.uniform(key, (layers, len(NORMED), cfg.hidden_size), jnp.float32, 0.5, 2.0)
    scales = [jax.random.uniform(key, (layers * shapes[name][0],), jnp.float32, 1e-3, 2e-3) for name in PRODUCTS]
    position = length if attention == "real" else CONTEXT  # the new token's
    angles = position * 10000.0 ** (-jnp.arange(cfg.head_dim // 2) / (cfg.head_dim // 2))  # RoPE at the position
    cos_sin = jnp.tile(jnp.concatenate([jnp.cos(angles), jnp.sin(angles)])[None], (COLS, 1)).astype(jnp.float32)
    x0 = jax.random.normal(key, (COLS, cfg.hidden_size), jnp.float32)
    return Inputs(weights, kv, bs, gains, scales, cos_sin, x0, table,
                  jnp.asarray([length], jnp.int32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--programs", type=int, default=backend_lib.NUM_SMS)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1, help="output rows reduce-added and zeroed (the batch)")
    ap.add_argument("--trial", default="", help="comma-joined: no-deps, no-store-wait, no-attn (see megakernel)")
    ap.add_argument("--products", default="s8", choices=["s8", "float16"], help="see megakernel")
    ap.add_argument("--convert", action="store_true", help="activations from the sums, converted (see megakernel)")
    ap.add_argument("--prefetch", type=int, default=0, help="ring steps ahead to prefetch weights into L2 (0: none)")
    ap.add_argument("--split", type=int, default=1, help="each product in split x split blocks (see plan)")
    ap.add_argument("--split-inputs", type=int, default=4, choices=[4, 8, 16],
                    help="inputs a converter thread splits into parts (--products s8 --convert)")
    ap.add_argument("--attention", default="stand-in", choices=["stand-in", "real"], help="see megakernel")
    ap.add_argument("--length", type=int, default=CONTEXT, help="(real attention) the positions in the cache")
    ap.add_argument("--page-size", type=int, default=16, help="(real attention) positions a page")
    ap.add_argument("--numerics", action="store_true",
                    help="the norms' gains and 1/rms and the products' scales (--products s8 --convert; see megakernel)")
    ap.add_argument("--check", action="store_true",
                    help="(--products s8 --convert) check the first layers' qkv sums and, with --attention real, "
                         "every phase against numpy (check_layers), then time")
    ap.add_argument("--served", action="store_true",
                    help="also time, in this process, the served batch-1 step: bfloat16 (the baseline) and int8's "
                         "cost outside the layers, for the step this skeleton would give (see served_steps)")
    ap.add_argument("--out", default="benchmarks/results/megakernel_skeleton_gpu.jsonl")
    args = ap.parse_args()
    cfg = LLAMA_8B
    if not cfg.num_heads <= args.programs <= backend_lib.NUM_SMS:
        ap.error(f"--programs must be {cfg.num_heads}-{backend_lib.NUM_SMS}: a head a program in attention, and "
                 f"every program resident for the waits; got {args.programs}")
    if not 1 <= args.rows <= COLS:
        ap.error(f"--rows must be 1-{COLS}, got {args.rows}")
    if args.length < 1 or args.page_size < 8:
        ap.error(f"--length must be at least 1 and --page-size at least 8, got {args.length} and {args.page_size}")
    try:
        check_config(cfg, args.page_size, programs=args.programs)
    except ValueError as e:
        ap.error(str(e))
    pool = 2 * -(-(args.length + 1) // args.page_size)  # pages of each kv head's pool: the sequence's are half
    kernel, phases = megakernel(cfg, args.layers, args.programs, args.stages, args.rows, args.trial, args.products,
                                args.convert, args.prefetch, args.split, args.split_inputs, args.numerics,
                                args.attention, args.page_size, pool)
    key = jax.random.PRNGKey(0)
    given = inputs(cfg, args.layers, phases, key, args.products, args.attention, args.length, args.page_size, pool,
                   args.convert)
    per_layer_refs = "per-layer" in args.trial.split(",")
    args_in, weights = given.flat(per_layer_refs), given.weights
    products = layer_products(cfg)
    shapes = [products[name] for name in PHASES]
    layer_weights = [weights[PRODUCTS.index(name)] for name in PHASES]
    baseline = skeleton(shapes, args.layers, args.programs, min(args.stages, 3))  # (its B of 14336 columns leaves
    # shared memory for at most 3)
    base_bs = [jax.random.randint(key, (COLS, k), -127, 128, jnp.int32).astype(jnp.int8) for _, k in shapes]
    mega_fn = jax.jit(kernel)
    if jax.default_backend() == "cpu":  # no interpreter for grid-shared semaphores: lower only
        mega_fn.trace(*args_in).lower(lowering_platforms=("cuda",))
        return print(f"lowered for CUDA ({args.layers} layers; no GPU here: nothing timed)")
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    t0 = time.perf_counter()
    mega_fn = mega_fn.lower(*args_in).compile()  # (timed apart: a compile and a hang look alike from outside)
    print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.check:
        if not (args.products == "s8" and args.convert):
            ap.error("--check needs --products s8 --convert (layer 0 then reads the step's input)")
        new_token = writes_new_token(args.numerics, args.attention, args.trial.split(","))
        pages_before = [np.asarray(a) for a in given.kv]  # (the kernel writes the new token's K/V in place)
        outs = jax.block_until_ready(mega_fn(*args_in))[:-1]
        if per_layer_refs:  # the pages the kernel wrote, in the layers' own arrays
            pools = args_in[len(PRODUCTS) * args.layers:][:len(given.kv) * args.layers]
            given = given._replace(kv=[jnp.concatenate(pools[i * args.layers:(i + 1) * args.layers])
                                       for i in range(len(given.kv))])
        check_layers(cfg, given, outs, args.rows, args.numerics, args.attention == "real", args.page_size,
                     new_token)
        if new_token:
            check_reference(cfg, given, pages_before, outs, args.page_size)
    copy = copy_bandwidth_device()
    mega = device_seconds(mega_fn, args_in, reps=5)
    base = device_seconds(jax.jit(baseline), (*layer_weights, *base_bs), reps=5)
    mega_again = device_seconds(mega_fn, args_in, reps=5)
    product_bytes = sum(w.size for w in weights)
    per_layer = min(mega, mega_again) / args.layers
    step = 32 * per_layer + 0.21e-3
    line = (f"{args.layers} layers: megakernel skeleton {mega * 1e6:.1f} / {mega_again * 1e6:.1f} us "
            f"({per_layer * 1e6:.1f} us a layer, attention in; products {product_bytes / min(mega, mega_again) / copy:.2f}"
            f" of the copy); session 22's skeleton {base * 1e6:.1f} us ({base / args.layers * 1e6:.1f} a layer, no "
            f"attention); a 32-layer step at this rate ~{step * 1e3:.2f} ms, ~{5.9e-3 / step:.2f}x bfloat16's ~5.9 ms "
            f"before numerics; copy {copy / 1e9:.0f} GB/s")
    label = (f"{args.products}{'+convert' if args.convert else ''} stages={args.stages} split={args.split} "
             f"prefetch={args.prefetch} {f'split_inputs={args.split_inputs} ' if args.convert else ''}"
             f"{'numerics ' if args.numerics else ''}attention={args.attention}"
             f"{f' length={args.length} page={args.page_size}' if args.attention == 'real' else ''} "
             f"trial={args.trial or '-'}")
    print(f"[{label}] {line}", flush=True)
    record(args.out, "int8_megakernel_skeleton", {"layers": args.layers, "programs": args.programs,
                                                   "stages": args.stages, "rows": args.rows,
                                                   "context": args.length if args.attention == "real" else CONTEXT,
                                                   "page_size": args.page_size if args.attention == "real" else None,
                                                   "session": SESSION, "seconds_again": mega_again,
                                                   "trial": args.trial or None, "products": args.products,
                                                   "convert": args.convert, "prefetch": args.prefetch,
                                                   "split": args.split, "numerics": args.numerics,
                                                   "attention": args.attention,
                                                   "split_inputs": args.split_inputs
                                                   if args.convert and args.products == "s8" else None},
           "seconds", mega, "s", "session 22's layer skeleton: the four products, grid barriers, no attention "
           "(same run)", base, higher_is_better=False)
    if args.served:
        served_steps(cfg, per_layer, args.out, {"layers": args.layers, "stages": args.stages, "session": SESSION,
                                                "products": args.products, "convert": args.convert,
                                                "trial": args.trial or None})


def check_layers(cfg, given: Inputs, outs: tuple, rows: int, numerics: bool, real_attention: bool,
                 page_size: int, new_token: bool) -> None:
    """Each phase's outputs of the first CHECKED_LAYERS layers from the kernel against float64 numpy of the same math
    on the kernel's own outputs of the phase before, so each phase is checked alone: a product is its inputs times the
    norm's gain (qkv, gate_up; numerics), times the int8 weights, times the scales (numerics); attention rotates a
    head's q, rounds it to bfloat16, and attends over its kv head's K and V pages (the table's, to the length; with
    numerics q, k and v times the 1/rms of the layer's input, and the new token's K/V too, which must also be
    written at its position), each head against its own largest output;
    down's inputs are SiLU(gate · r) · up · r with r the 1/rms of wo's sums (numerics; else 1); with numerics wo
    adds the layer's input and down wo's sums (the residual stream). Without real attention only qkv is checked
    (the stand-in's outputs are no attention).
    Raises SystemExit if any phase is off by more than its bound."""
    def f64(a):
        return np.asarray(jnp.asarray(a, jnp.float32), np.float64)

    weights, scales = dict(zip(PRODUCTS, given.weights)), dict(zip(PRODUCTS, given.scales))
    gains, cos_sin, x0 = f64(given.gains), f64(given.cos_sin), f64(given.x0)
    layers = len(outs[0])
    got = [f64(o)[:, :rows] for o in outs]  # each phase's [layers, rows, n]

    def product(x, name, layer, gain=None):
        n = weights[name].shape[0] // layers
        if numerics and gain is not None:
            x = x * gains[layer, gain]
        y = x @ f64(weights[name][layer * n:(layer + 1) * n]).T
        return y * f64(scales[name][layer * n:(layer + 1) * n]) if numerics else y

    def error(phase, layer, want):
        return np.abs(got[phase][layer] - want).max() / np.abs(want).max()

    errors = {}
    hd, half = cfg.head_dim, cfg.head_dim // 2
    cos, sin = cos_sin[:rows, :half], cos_sin[:rows, half:]
    full = numerics and real_attention  # q k v times the norm's 1/rms (see megakernel)
    group = cfg.num_heads // cfg.num_kv_heads
    table, length = np.asarray(given.table), int(given.length[0])
    if real_attention:  # each kv head's pages [layers · kv heads, pool, page, hd]
        k_pages, v_pages = (f64(a).reshape(layers * cfg.num_kv_heads, -1, page_size, hd) for a in given.kv)
    for layer in range(min(layers, CHECKED_LAYERS)):
        x = x0[:rows] if layer == 0 else got[4][layer - 1]  # the layer's input: h2 of the layer before
        errors[f"{layer}: qkv"] = (error(0, layer, product(x, "wqkv", layer, 0)), 1e-5)
        if not real_attention:
            continue

        def rotated(a):
            return np.concatenate([a[:, :half] * cos - a[:, half:] * sin, a[:, half:] * cos + a[:, :half] * sin], 1)

        def bf16(a):
            return f64(jnp.asarray(a, jnp.bfloat16))

        r = 1 / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-5) if full else 1.0
        heads = []
        for head in range(cfg.num_heads):
            q_at, k_at, v_at = (t * hd for t in qkv_tiles(cfg, head))
            q = bf16(rotated(got[0][layer][:, q_at:q_at + hd] * r))
            lh = layer * cfg.num_kv_heads + head // group
            k, v = (pages[lh][table].reshape(-1, hd)[:length] for pages in (k_pages, v_pages))  # its positions
            if new_token:  # the step's new token: its k (rotated) and v from qkv's sums, times 1/rms, in bfloat16
                k_new = bf16(rotated(got[0][layer][:, k_at:k_at + hd] * r))
                v_new = bf16(got[0][layer][:, v_at:v_at + hd] * r)
                if head % group == 0:  # written at its position (length) in the sequence's pages
                    page, offset = table[length // page_size], length % page_size
                    stored = max(np.abs(pages[lh, page, offset] - new[0]).max() / np.abs(new).max()
                                 for pages, new in ((k_pages, k_new), (v_pages, v_new)))
                    errors[f"{layer}: new K/V {head // group}"] = (stored, 1e-2)
                k, v = np.concatenate([k, k_new]), np.concatenate([v, v_new])
            sc = q @ k.T / np.sqrt(hd)
            pr = np.exp(sc - sc.max(axis=1, keepdims=True))
            want = pr @ v / pr.sum(axis=1, keepdims=True)
            heads.append(np.abs(got[1][layer][:, head * hd:(head + 1) * hd] - want).max() / np.abs(want).max())
        errors[f"{layer}: attention"] = (max(heads), 3e-2)  # each head against its own largest; bfloat16 q and P
        # with numerics, the residual stream: wo's sums are h1 = x + wo(attention), down's h2 = h1 + down(...)
        errors[f"{layer}: wo"] = (error(2, layer, product(got[1][layer], "wo", layer) + (x if numerics else 0)), 1e-5)
        errors[f"{layer}: gate_up"] = (error(3, layer, product(got[2][layer], "w_gate_up", layer, 1)), 1e-5)
        r = 1 / np.sqrt((got[2][layer] ** 2).mean(axis=1, keepdims=True) + 1e-5) if numerics else 1.0
        g = got[3][layer].reshape(rows, -1, 2, BLOCK_N)  # gate and up interleaved by 128 channels
        gate, up = g[:, :, 0].reshape(rows, -1) * r, g[:, :, 1].reshape(rows, -1) * r
        errors[f"{layer}: down"] = (error(4, layer, product(gate / (1 + np.exp(-gate)) * up, "w_down", layer)
                                           + (got[2][layer] if numerics else 0)), 1e-4)
    print("check, of each phase's largest output: " + ", ".join(f"{name} {e:.1e}" for name, (e, _) in errors.items()),
          flush=True)
    if any(e > bound or not np.isfinite(e) for e, bound in errors.values()):
        raise SystemExit("megakernel skeleton check failed")


def check_reference(cfg, given: Inputs, pages_before: list, outs: tuple, page_size: int) -> None:
    """The kernel's output of its last layer (h2) and the K/V it wrote, against the megakernel's jnp reference
    (pallas_kernels.decode_megakernel.reference.decode_layers) on the same inputs taken as stacked layers: every
    layer end to end, where check_layers takes each phase alone. The skeleton's inputs are the reference's layouts
    (qkv by KV head, gate_up in 128-channel blocks, a (layer, KV head)'s pages contiguous). Raises SystemExit past
    the bounds (bfloat16 P in the kernel, float32 in the reference)."""
    from pallas_kernels.decode_megakernel.reference import StackedLayers, decode_layers

    layers = outs[0].shape[0]
    half = cfg.head_dim // 2
    reference = jax.jit(functools.partial(decode_layers, dataclasses.replace(cfg, num_layers=layers),
                                          inv_freq=10000.0 ** (-np.arange(half) / half), page_size=page_size))
    with jax.default_matmul_precision("highest"):
        h, k_pages, v_pages = reference(StackedLayers(tuple(given.weights), tuple(given.scales), given.gains),
                                        given.x0[:1], *[jnp.asarray(a) for a in pages_before], given.table[None],
                                        given.length)

    def error(got, want):
        got, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (got, want))
        return np.abs(got - want).max() / np.abs(want).max()

    errors = {"h2 of the last layer": error(outs[-1][-1, :1], h), "K pages": error(given.kv[0], k_pages),
              "V pages": error(given.kv[1], v_pages)}
    print("against the reference, every layer: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()), flush=True)
    if any(e > 3e-2 or not np.isfinite(e) for e in errors.values()):
        raise SystemExit("megakernel skeleton's reference check failed")


def served_steps(cfg, per_layer: float, out: str, config: dict, steps: int = 100, reps: int = 3,
                 few: int = 4) -> None:
    """The served decode step at batch 1 (context CONTEXT), timed as int8_gpu.py times it: bfloat16 with every layer
    of cfg (the baseline), and int8 with every layer (today's ratio) and with `few` layers. From the two int8 steps,
    a layer and what the step costs outside its layers (embedding, final norm, head, sampling): a step of `few`
    layers is still longer than its dispatch (at 1 or 2 layers the host's dispatch sets the pace, and the difference
    is no layer). A megakernel at per_layer seconds a layer would make a step of layers · per_layer + that rest."""
    def median_step(layers: int, dtype) -> float:
        c = dataclasses.replace(cfg, num_layers=layers)
        weights = random_weights(c, jax.random.PRNGKey(0), jnp.bfloat16)
        if dtype == "int8":
            weights = quantize_weights(weights, QuantConfig(mode="int8"), jnp.bfloat16)
        step, state, inp = decode_step(c, weights, 1, CONTEXT)
        times = []
        for _ in range(reps):
            t, state = run_steps(step, weights, state, inp, steps)
            times.append(t)
        return float(np.median(times))

    layers = cfg.num_layers
    bf16 = median_step(layers, "bfloat16")
    int8, int8_few = median_step(layers, "int8"), median_step(few, "int8")
    layer = (int8 - int8_few) / (layers - few)
    rest = int8 - layers * layer
    estimate = layers * per_layer + rest
    print(f"served, batch 1: bfloat16 {bf16 * 1e3:.3f} ms a step ({layers} layers), int8 {int8 * 1e3:.3f} "
          f"({bf16 / int8:.3f}x); int8 at {few} layers {int8_few * 1e3:.3f} ms: a layer {layer * 1e6:.1f} us, outside "
          f"the layers {rest * 1e6:.0f} us; a megakernel step at {per_layer * 1e6:.1f} us a layer ~{estimate * 1e3:.3f} "
          f"ms, {bf16 / estimate:.3f}x bfloat16 (before its numerics)", flush=True)
    record(out, "int8_megakernel_step_estimate", {**config, "context": CONTEXT, "per_layer": per_layer,
                                                  "int8_outside_layers": rest, "int8_served_layer": layer,
                                                  "int8_served_step": int8, "int8_few_layers": [few, int8_few]},
           "seconds", estimate, "s", "served bfloat16 step, batch 1 (same process)", bf16, higher_is_better=False)


if __name__ == "__main__":
    main()
