"""Ring-attention prefill over 2 GPUs against one GPU, and how much of the ring's communication is hidden.

One layer's causal self-attention of an 8B-shaped model (32 query heads, 8 KV heads, head_dim 128,
bf16), all queries of the context at once (a prefill), computed tile by tile (jaxserve.parallel.ring).

1. The longest context that fits: per device, the compiled program's own memory (XLA's memory
   analysis: arguments, outputs, temporaries) plus what serving the whole model would also hold there,
   the other layers' KV cache (--kv-layers) and the weights (--weights-gb), within --memory-fraction of
   the device. Found for one GPU and for the ring over two, without running anything.
2. Timing: one GPU at its longest context, the ring at its own; both are capped so that one call takes
   about --seconds-per-call (quadratic cost, estimated from a short run); the table says when a cap bound.
   The ring is also timed at the one-GPU length (same work, two devices).
3. Overlap: the ring as is, the same program with the K/V blocks kept in place (no ppermute, same
   compute), and the ppermutes alone; hidden fraction = (compute + communication - ring) / communication.

Usage (2 H200s): PYTHONPATH=. python3 benchmarks/ring_attention_gpu.py [--out benchmarks/results/ring_attention_gpu.jsonl]
CPU check:       PYTHONPATH=. python3 benchmarks/ring_attention_gpu.py --smoke   (2 fake CPU devices, tiny shapes)
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_rows, record, timed  # noqa: E402
from jaxserve.parallel import ring  # noqa: E402

BENCH = "ring_attention_gpu"


class Setup:
    """The shapes, the 2-device mesh, the three programs timed and their inputs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.heads, self.kv_heads, self.hd = (4, 2, 16) if args.smoke else (32, 8, 128)
        self.tile = args.tile
        self.dtype = jnp.bfloat16
        self.devices = jax.devices()[:2]
        if len(self.devices) < 2:
            raise SystemExit(f"needs 2 devices, found {len(jax.devices())}")
        self.mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=self.devices)
        self.n = 2
        self.scale = 1.0 / np.sqrt(self.hd)

    def single(self):
        def f(q, k, v, pos, valid):
            part = ring.positional_attention(q, pos, k, v, pos, valid, causal=True, scale=self.scale, diagonal=True,
                                             tile=self.tile)
            return ring.finish(part, q.dtype)

        return jax.jit(f)

    def ring(self, communicate: bool = True):
        return jax.jit(ring.ring_attention_sharded(self.mesh, causal=True, communicate=communicate, tile=self.tile))

    def comm_only(self):
        """The ring's n - 1 hops of each device's K/V block, and nothing else."""
        tokens = PartitionSpec(None, "seq")
        hops = [(i, (i + 1) % self.n) for i in range(self.n)]

        def body(k, v, pos, valid):
            block = (k, v, pos, valid)
            for _ in range(self.n - 1):
                block = jax.lax.ppermute(block, "seq", hops)
            return block[0][:, :1]

        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(tokens,) * 4, out_specs=tokens, check_vma=False))

    def where(self, sharded: bool):
        return NamedSharding(self.mesh, PartitionSpec(None, "seq")) if sharded else \
            jax.sharding.SingleDeviceSharding(self.devices[0])

    def inputs(self, t: int, sharded: bool):
        """q, k, v, positions and their validity of a `t`-token context, made where they live."""
        pos = ring.zigzag_order(t, self.n) if sharded else np.arange(t)

        def make(key):
            kq, kk, kv = jax.random.split(key, 3)
            q = jax.random.normal(kq, (1, t, self.heads, self.hd), self.dtype)
            k = jax.random.normal(kk, (1, t, self.kv_heads, self.hd), self.dtype)
            v = jax.random.normal(kv, (1, t, self.kv_heads, self.hd), self.dtype)
            p = jnp.asarray(pos, jnp.int32)[None]
            return q, k, v, p, p >= 0

        return jax.jit(make, out_shardings=(self.where(sharded),) * 5)(jax.random.key(t))

    def abstract(self, t: int, sharded: bool):
        where = self.where(sharded)
        shape = lambda h, dt: jax.ShapeDtypeStruct((1, t, h, self.hd) if h else (1, t), dt, sharding=where)  # noqa: E731
        return (shape(self.heads, self.dtype), shape(self.kv_heads, self.dtype), shape(self.kv_heads, self.dtype),
                shape(0, jnp.int32), shape(0, jnp.bool_))

    @property
    def unit(self) -> int:
        """Context lengths are multiples of this: 2n zig-zag chunks of whole tiles."""
        return 2 * self.n * self.tile

    def flops(self, t: int) -> float:
        return 4.0 * self.heads * self.hd * t * t / 2  # causal: QK^T and PV over the lower triangle


def program_bytes(fn, abstract) -> int | None:
    """Per-device bytes of a compiled program (arguments + outputs + temporaries), from XLA's analysis."""
    stats = fn.lower(*abstract).compile().memory_analysis()
    return None if stats is None else int(stats.argument_size_in_bytes + stats.output_size_in_bytes
                                          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def longest_fitting(s: Setup, fn, sharded: bool, budget: int, reserve_per_token: float) -> tuple[int, int] | None:
    """The longest context (a multiple of s.unit) whose per-device bytes, program plus reserve, fit `budget`.
    Program memory is linear in the context (fixed tiles): fitted from two sizes, then checked."""
    per_device = (lambda t: t // s.n) if sharded else (lambda t: t)
    t0, t1 = 64 * s.unit, 128 * s.unit
    b0, b1 = program_bytes(fn, s.abstract(t0, sharded)), program_bytes(fn, s.abstract(t1, sharded))
    if b0 is None or b1 is None:
        return None
    slope = (b1 - b0) / (t1 - t0) + reserve_per_token * per_device(1)
    base = b0 - (b1 - b0) / (t1 - t0) * t0
    t = int((budget - base) / slope) // s.unit * s.unit
    while t >= s.unit:
        used = program_bytes(fn, s.abstract(t, sharded)) + reserve_per_token * per_device(t)
        if used <= budget:
            return t, int(used)
        t = int(t * 0.97) // s.unit * s.unit
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/ring_attention_gpu.jsonl")
    parser.add_argument("--smoke", action="store_true", help="2 fake CPU devices, tiny shapes, fixed lengths")
    parser.add_argument("--tile", type=int, default=None, help="query/key tile (default 2048; 32 with --smoke)")
    parser.add_argument("--kv-layers", type=int, default=32, help="layers whose KV cache the context must also hold")
    parser.add_argument("--weights-gb", type=float, default=16.0, help="weights held on every device (GB)")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of each device's memory")
    parser.add_argument("--seconds-per-call", type=float, default=15.0, help="cap on one timed call (estimated)")
    parser.add_argument("--reps", type=int, default=1, help="timed calls after the warm-up")
    args = parser.parse_args()
    args.tile = args.tile or (32 if args.smoke else 2048)
    if args.smoke:
        args.out = args.out.replace(".jsonl", "_smoke.jsonl")
    s = Setup(args)
    config = {"heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.hd, "dtype": "bfloat16", "tile": s.tile,
              "devices": len(s.devices), "kv_layers": args.kv_layers, "weights_gb": args.weights_gb}
    single, ringed, still, comm = s.single(), s.ring(), s.ring(communicate=False), s.comm_only()
    rows = []

    # correctness at a short length: ring over 2 devices against one device
    t = 8 * s.unit
    q, k, v, pos, valid = s.inputs(t, sharded=True)  # zig-zag order
    got = np.asarray(ringed(q, k, v, pos, valid), np.float32)
    natural = np.argsort(ring.zigzag_order(t, s.n))
    one = jax.device_put((q[:, natural], k[:, natural], v[:, natural], jnp.arange(t, dtype=jnp.int32)[None],
                          jnp.ones((1, t), bool)), s.devices[0])
    ref = np.asarray(single(*one), np.float32)[:, ring.zigzag_order(t, s.n)]
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    rows.append(record(args.out, BENCH, {**config, "tokens": t}, "ring_vs_single_rel_err", err, "relative"))
    assert err < 2e-2, f"ring attention differs from one device: relative error {err:.3g}"

    # 1. the longest contexts that fit
    limit = (s.devices[0].memory_stats() or {}).get("bytes_limit")
    reserve = (args.kv_layers - 1) * 2 * s.kv_heads * s.hd * 2  # the other layers' K and V of a token, bf16
    budget = int(args.memory_fraction * (limit or 0) - args.weights_gb * 1e9)
    fit = {name: longest_fitting(s, fn, name == "ring", budget, reserve) if limit else None
           for name, fn in (("single", single), ("ring", ringed))}
    if None in fit.values():  # CPU: no memory limit to fit
        fits = {"single": 16 * s.unit, "ring": 32 * s.unit}
    else:
        fits = {name: tokens for name, (tokens, _) in fit.items()}
        for name, (tokens, used) in fit.items():
            rows.append(record(args.out, BENCH, {**config, "device_bytes_used": used, "device_bytes_limit": limit},
                               f"{name}_longest_context", tokens, "tokens",
                               *(("single", fits["single"]) if name == "ring" else ())))

    # 2. timing, capped to about --seconds-per-call per call (cost grows with the square of the context)
    probe = 16 * s.unit
    rate = timed(single, *s.inputs(probe, sharded=False), reps=1) / probe ** 2
    cap = int(np.sqrt(args.seconds_per_call / rate)) // s.unit * s.unit
    t_single = max(s.unit, min(fits["single"], cap))
    t_ring = max(s.unit, min(fits["ring"], int(np.sqrt(2 * args.seconds_per_call / rate)) // s.unit * s.unit))
    cfg = {**config, "capped_by_time": t_single < fits["single"] or t_ring < fits["ring"],
           "longest_fitting": fits}
    sec_single = timed(single, *s.inputs(t_single, sharded=False), reps=args.reps)
    sec_ring_same = timed(ringed, *s.inputs(t_single, sharded=True), reps=args.reps)
    x3 = s.inputs(t_ring, sharded=True)
    sec_ring = timed(ringed, *x3, reps=args.reps)
    sec_still = timed(still, *x3, reps=args.reps)
    sec_comm = timed(comm, *x3[1:], reps=max(3, args.reps))
    del x3
    for name, t, sec in (("single", t_single, sec_single), ("ring_same_length", t_single, sec_ring_same),
                         ("ring", t_ring, sec_ring)):
        rows.append(record(args.out, BENCH, {**cfg, "tokens": t}, f"{name}_prefill_attention", sec, "s",
                           *(("single", sec_single) if name != "single" else ()), higher_is_better=False))
        rows.append(record(args.out, BENCH, {**cfg, "tokens": t}, f"{name}_tflops_per_device",
                           s.flops(t) / sec / 1e12 / (1 if name == "single" else s.n), "TFLOP/s"))
    rows.append(record(args.out, BENCH, {**cfg, "tokens": t_ring}, "ring_tokens_per_s", t_ring / sec_ring, "tokens/s",
                       "single", t_single / sec_single))

    # 3. overlap of the ppermutes with the compute
    hidden = float(np.clip((sec_still + sec_comm - sec_ring) / sec_comm, 0.0, 1.0)) if sec_comm > 0 else 1.0
    for metric, value, unit in (("ring_without_communication", sec_still, "s"), ("ring_communication_only", sec_comm, "s"),
                                ("ring_communication_hidden_fraction", hidden, "fraction"),
                                ("ring_exposed_communication", max(0.0, sec_ring - sec_still), "s")):
        rows.append(record(args.out, BENCH, {**cfg, "tokens": t_ring}, metric, value, unit))

    print_rows(rows, ("tokens",))


if __name__ == "__main__":
    main()
