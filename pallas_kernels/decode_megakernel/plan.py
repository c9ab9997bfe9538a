"""What the decode megakernel is built for, decided on the host: its tiles, its warpgroups' registers, a layer's
phases in the order the programs run them, and the checks of what it takes (mosaic_gpu.py builds the kernel).

A layer is five phases: qkv, attention, wo, gate_up, down. A product's phase is [BLOCK_N, BLOCK_K] weight tiles cut
into units of one tile's BLOCK_K inputs, streamed stream-K over every program (one an SM); attention is a query head
a program. A unit's inputs are the phase before's outputs, so a unit waits only for the tiles it reads, counted on a
semaphore a tile: the next phase starts on the first tiles while the last are still running.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backend as backend_lib
from pallas_kernels.quantized_matmul import mosaic_gpu as qmm_gpu

BLOCK_N, BLOCK_K, COLS = 128, 256, 8  # output rows a tile, inputs a step, activation rows (the batch, padded)
BATCH = 1  # rows decoded: one sequence (its pages, its new K/V); the activations' other COLS rows stay unread
STAGES = 2  # ring slots: at 3 the kernel's shared memory is ~240 KB, past the H100's 227 KB a block
ORDER = ("wqkv", "attn", "wo", "w_gate_up", "w_down")  # a layer's phases in a decode step's order
PRODUCTS = tuple(name for name in ORDER if name != "attn")  # the phases with weights, in that order
NORMED = ("wqkv", "w_gate_up")  # the products whose inputs are RMS-normed (attention's, the MLP's): gains 0, 1
LOG2E = 1.4426950408889634  # the softmax runs in base 2 (exp2)
P_SWIZZLE = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # P [keys, 16] bf16 and V beside it
INT8_SWIZZLE = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))  # weight tiles and int8 parts

# Warpgroups: two compute (0, 1: 64 output rows each), the producer (2: every TMA copy in) and the converter (3:
# sums to int8 parts). Registers a thread: the block's 64K at launch, a share each (in steps of 8); the producer gives
# its down to 40, the converter to what it needs (split_tile holds its inputs, their digits and addresses), and the
# compute warpgroups take what is left.
WARPGROUPS = 4
LAUNCH_REGISTERS = 65536 // (128 * WARPGROUPS) // 8 * 8
PRODUCER_REGISTERS = 40
CONVERTER_REGISTERS = 128
COMPUTE_REGISTERS = min(232, (LAUNCH_REGISTERS * WARPGROUPS - PRODUCER_REGISTERS - CONVERTER_REGISTERS) // 2 // 8 * 8)


def layer_products(cfg) -> dict[str, tuple[int, int]]:
    """(n, k) of each quantized product of a layer: output channels, inputs."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return {"wqkv": (qkv, d), "wo": (d, d), "w_gate_up": (2 * f, d), "w_down": (d, f)}


def qkv_tiles(cfg, head):
    """(q, k, v) tiles of qkv's sums for a head (an int or traced), in the served order (jaxserve.model.weights.Layer:
    by KV head, its query heads, its key, its value; a tile is a head: head_dim == BLOCK_N)."""
    group = cfg.num_heads // cfg.num_kv_heads
    g, i = divmod(head, group) if isinstance(head, int) else (lax.div(head, group), lax.rem(head, group))
    return g * (group + 2) + i, g * (group + 2) + group, g * (group + 2) + group + 1


def check_config(cfg, page_size: int, page_dtype=jnp.bfloat16) -> None:
    """Raises ValueError naming what of the model or the pages the kernel does not take: a head is a tile of BLOCK_N,
    every product's outputs whole tiles and its inputs whole steps of BLOCK_K, a head a program, the pages bfloat16
    and a multiple of 8 positions dividing a K/V block of BLOCK_N."""
    if cfg.head_dim != BLOCK_N:
        raise ValueError(f"the decode megakernel takes head_dim {BLOCK_N} (a head is a tile), got {cfg.head_dim}")
    for name, (n, k) in layer_products(cfg).items():
        if n % BLOCK_N or k % BLOCK_K:
            raise ValueError(f"the decode megakernel takes products of whole [{BLOCK_N}, {BLOCK_K}] tiles: {name} is "
                             f"[{n}, {k}]")
    programs = backend_lib.num_sms()
    if not cfg.num_heads <= programs or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"the decode megakernel runs a query head a program: num_heads must be at most {programs} "
                         f"and a multiple of num_kv_heads, got {cfg.num_heads} and {cfg.num_kv_heads}")
    if page_size % 8 or BLOCK_N % page_size:
        raise ValueError(f"the decode megakernel takes pages of a multiple of 8 positions that divides {BLOCK_N}, got "
                         f"page_size={page_size}")
    if jnp.dtype(page_dtype) != jnp.bfloat16:
        raise ValueError(f"the decode megakernel reads bfloat16 K/V pages, got {jnp.dtype(page_dtype)}")


@dataclasses.dataclass(frozen=True)
class Phase:
    """A phase of a layer: a product stream-K over every program, or attention, a head a program."""
    name: str
    n: int  # output columns (weight rows)
    k: int  # inputs
    tiles: int
    steps: int  # units a tile (attention: 0, a head's units come from the step's length)
    fragments: int  # the most tiles a program's run touches
    stream_k: bool  # False: attention

    @property
    def units(self) -> int:
        return self.tiles * self.steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One build of the kernel: the model (a jaxserve ModelConfig), its stacked layers, the programs (one an SM) and
    the K/V pages it reads, a pool of `pool` pages of `page_size` positions a KV head and layer. Raises ValueError
    on what the kernel cannot run (check_config's are the caller's to raise first)."""
    model: Any
    layers: int
    programs: int
    page_size: int
    pool: int

    def __post_init__(self):
        gate_up = self.phases[ORDER.index("w_gate_up")]
        if gate_up.units // self.programs < gate_up.steps:
            raise ValueError(f"the kernel sums a row's squares over a program's first {gate_up.steps} gate_up units: "
                             f"runs of {gate_up.units // self.programs} units at {self.programs} programs are shorter")

    @functools.cached_property
    def phases(self) -> tuple[Phase, ...]:
        """A layer's phases in ORDER."""
        cfg, products = self.model, layer_products(self.model)
        phases = []
        for name in ORDER:
            if name == "attn":
                phases.append(Phase(name, cfg.num_heads * cfg.head_dim, BLOCK_K, cfg.num_heads, 0, 1, False))
                continue
            n, k = products[name]
            tiles, steps = n // BLOCK_N, k // BLOCK_K
            phases.append(Phase(name, n, k, tiles, steps, qmm_gpu.stream_k_plan(steps, tiles, self.programs)[1], True))
        return tuple(phases)

    @property
    def group(self) -> int:
        """Query heads a KV head."""
        return self.model.num_heads // self.model.num_kv_heads

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each phase's first tile in a layer's tile counts (attention's tiles are its heads)."""
        tiles = [self.model.num_heads if ph.name == "attn" else ph.n // BLOCK_N for ph in self.phases]
        return tuple(sum(tiles[:j]) for j in range(len(tiles) + 1))

    @property
    def per_layer_tiles(self) -> int:
        return self.offsets[-1]
