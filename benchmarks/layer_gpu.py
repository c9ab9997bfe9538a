"""The int8 decode-layer kernel (pallas_kernels/quantized_layer) against the model's path for the same math, on the H100.

For `--layers` 8B-shaped layers of random int8 weights, at batch 1, both paths take each layer from its attention
output to the next layer's qkv (wo, residual, norm, gate_up, SiLU·up, down, residual, norm, qkv), chained: the next
layer's attention output stands in as the first d of the qkv before it (attention itself is left out of both).

- kernel: one `decode_layer` kernel a layer (plus the small XLA fusion that makes its float16 input);
- model: the products through jaxserve.model.quant.linear (one int8 Mosaic GPU kernel a product) with the model's
  XLA glue between them (residual adds, norms, SiLU·up, conversions), exactly as transformer._layer writes them.

Device time of a whole chain from a profile, in the same process; the outputs of the two paths are compared.

    PYTHONPATH=. python3 benchmarks/layer_gpu.py [--layers 8]    # writes results/layer_gpu.jsonl
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import record  # noqa: E402
from benchmarks.int8_gpu import LLAMA_8B, device_seconds  # noqa: E402
from benchmarks.kernels_gpu import copy_bandwidth_device  # noqa: E402
from pallas_kernels.quantized_layer import LayerWeights  # noqa: E402

EPS = 1e-5


def random_layers(layers: int, d: int, f: int, nq: int) -> list[LayerWeights]:
    out = []
    for i in range(layers):
        keys = iter(jax.random.split(jax.random.PRNGKey(i), 10))

        def values(*shape):
            return jax.random.randint(next(keys), shape, -127, 128, jnp.int32).astype(jnp.int8)

        def scales(*shape, fan_in):
            return jax.random.uniform(next(keys), shape, jnp.float32, 0.5, 1.5) / (73 * np.sqrt(fan_in))

        def gain():
            return jax.random.uniform(next(keys), (d,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)

        out.append(LayerWeights(values(d, d), scales(d, fan_in=d), gain(), values(f, 2, d), scales(2, f, fan_in=d),
                                values(d, f), scales(d, fan_in=f), gain(), values(nq, d), scales(nq, fan_in=d)))
    return out


def kernel_chain(ws, a, h, trial=""):
    from pallas_kernels.quantized_layer.mosaic_gpu import decode_layer

    from benchmarks.ring_probes import probe

    options = dict(item.split("=") for item in trial.split(",") if "=" in item)
    trial = ",".join(item for item in trial.split(",") if "=" not in item)
    with probe(options.pop("probe", None)):  # (traced inside: the stand-in ring step goes into the kernel)
        for w in ws:
            h, qkv = decode_layer(a, h, w, eps=EPS, trial=trial, **{k: int(v) for k, v in options.items()})
            a = qkv[:, : a.shape[1]]
    return h, qkv


def model_chain(ws, a, h):
    from jaxserve.model.quant import QuantizedArray, linear
    from jaxserve.model.transformer import _pad_rows, normed_linear

    rows = a.shape[0]
    h = _pad_rows(h, -rows % 8)  # the decode step pads its rows once
    for w in ws:
        def q(v, s):
            return QuantizedArray(v, s[None])

        h = h + linear(_pad_rows(a, h.shape[0] - rows), q(w.wo, w.wo_scales))
        gu = normed_linear(h, w.mlp_norm, q(w.gate_up, w.gate_up_scales.T), EPS)
        h = h + linear(jax.nn.silu(gu[..., 0]) * gu[..., 1], q(w.down, w.down_scales))
        qkv = normed_linear(h, w.attn_norm, q(w.qkv, w.qkv_scales), EPS)
        a = qkv[:rows, : a.shape[1]]
    return h[:rows], qkv[:rows]


def profile(w, a, h, directory: str) -> None:
    """One layer kernel traced by Mosaic GPU's profiler (after an unprofiled call: it traces a kernel's first call
    only), summarised per phase: for each region, over the warpgroups that ran it, the median and largest time
    spent, and when the phase's last warpgroup left it. Profiled times run long (the notes of session 20 found
    1.75x on the fused MLP): read the shape, not the microseconds."""
    import collections
    import glob
    import json

    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels.quantized_layer.mosaic_gpu import decode_layer

    os.makedirs(directory, exist_ok=True)  # (the profiler writes into it, and fails if it is missing)
    jax.block_until_ready(jax.jit(lambda a, h, w: decode_layer(a, h, w, eps=EPS))(a, h, w))
    params = plgpu.CompilerParams(profile_space=256, profile_dir=directory)
    jax.block_until_ready(jax.jit(lambda a, h, w: decode_layer(a, h, w, eps=EPS, compiler_params=params))(a, h, w))
    path = max(glob.glob(os.path.join(directory, "*.json")), key=os.path.getmtime)
    events = json.load(open(path))["traceEvents"]
    t0 = min(e["ts"] for e in events)
    spans = collections.defaultdict(list)  # region -> [(tid, start, end)]
    open_at = {}
    for e in events:
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"] - t0
        else:
            spans[e["name"]].append((e["tid"], open_at.pop(key), e["ts"] - t0))
    print(f"{path}: {len(events)} events; kernel {max(e['ts'] for e in events) - t0:.1f} us")
    print(f"{'region':18s} {'count':>5s} {'median us':>9s} {'max us':>7s} {'first in':>8s} {'last out':>8s}")
    for name in sorted(spans, key=lambda n: min(s for _, s, _ in spans[n])):
        durations = sorted(end - start for _, start, end in spans[name])
        # a warpgroup may run a region several times (fragments): its total
        per_wg = collections.Counter()
        for tid, start, end in spans[name]:
            per_wg[tid] += end - start
        totals = sorted(per_wg.values())
        print(f"{name:18s} {len(durations):5d} {totals[len(totals) // 2]:9.2f} {totals[-1]:7.2f} "
              f"{min(s for _, s, _ in spans[name]):8.1f} {max(e for _, _, e in spans[name]):8.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trials", default="", help="semicolon-separated kernel trials also timed (wrong outputs, a "
                    "bound): no-wait (no waits for the previous phase's tiles: phases overlap), no-epilogue (owners "
                    "finish no tile), comma-joined; each trial's outputs are compared with the model path's; "
                    "stages=N (the ring's depth) times a correct variant; probe=copies|s8|s8chunk swaps the ring step for "
                    "benchmarks/ring_probes.py's stand-in")
    ap.add_argument("--profile-dir", default="", help="trace one layer kernel's named regions per warpgroup "
                    "(Mosaic GPU's profiler) into this directory, print where each phase's time goes, then exit")
    ap.add_argument("--out", default="benchmarks/results/layer_gpu.jsonl")
    args = ap.parse_args()
    cfg = LLAMA_8B
    d, f = cfg.hidden_size, cfg.intermediate_size
    nq = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    print(f"{jax.devices()[0]} jax {jax.__version__}", flush=True)
    ws = random_layers(args.layers, d, f, nq)
    key = jax.random.PRNGKey(99)
    a = jax.random.normal(key, (1, d), jnp.float32).astype(jnp.bfloat16)
    h = (jax.random.normal(jax.random.PRNGKey(98), (1, d), jnp.float32) * 4).astype(jnp.bfloat16)
    if args.profile_dir:
        return profile(ws[0], a, h, args.profile_dir)
    kernel_fn, model_fn = jax.jit(kernel_chain), jax.jit(model_chain)
    hm, qm = model_fn(ws, a, h)

    def differences(fn):  # fn's outputs against the model path's: largest difference over largest value
        return tuple(float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
                           / jnp.abs(want.astype(jnp.float32)).max()) for got, want in zip(fn(ws, a, h), (hm, qm)))

    diff_h, diff_q = differences(kernel_fn)
    print(f"outputs after {args.layers} layers, largest difference over largest value: h {diff_h:.2e}, "
          f"qkv {diff_q:.2e}", flush=True)
    copy = copy_bandwidth_device()
    per_layer_bytes = sum(x.size for x in (ws[0].wo, ws[0].gate_up, ws[0].down, ws[0].qkv))
    times = {}
    for name, fn in (("model", model_fn), ("kernel", kernel_fn), ("model again", model_fn),
                     ("kernel again", kernel_fn)):
        times[name] = device_seconds(fn, (ws, a, h), reps=args.reps)
        t = times[name] / args.layers
        print(f"{name:13s} {t * 1e6:7.1f} us a layer ({per_layer_bytes / t / copy:.2f} of the copy)", flush=True)
    kernel_s = min(times["kernel"], times["kernel again"]) / args.layers
    model_s = min(times["model"], times["model again"]) / args.layers
    print(f"kernel against model: {model_s / kernel_s:.3f}x; copy {copy / 1e9:.0f} GB/s", flush=True)
    config = {"layers": args.layers, "batch": 1, "shapes": "llama3-8b", "difference_h": diff_h,
              "difference_qkv": diff_q, "copy_GBps": copy / 1e9}
    record(args.out, "int8_decode_layer_kernel", config, "seconds_per_layer", kernel_s, "s",
           "the model's path: one int8 kernel a product, XLA glue between (device time)", model_s,
           higher_is_better=False)
    for trial in filter(None, args.trials.split(";")):
        fn = jax.jit(functools.partial(kernel_chain, trial=trial))
        dh, dq = differences(fn)
        t = device_seconds(fn, (ws, a, h), reps=args.reps) / args.layers
        print(f"trial {trial:24s} {t * 1e6:7.1f} us a layer ({per_layer_bytes / t / copy:.2f} of the copy); outputs "
              f"h {dh:.1e}, qkv {dq:.1e} from the model's", flush=True)
        record(args.out, "int8_decode_layer_kernel", {"layers": args.layers, "trial": trial, "difference_h": dh,
                                                      "difference_qkv": dq}, "seconds_per_layer", t,
               "s", "the kernel as built, same run", kernel_s, higher_is_better=False)


if __name__ == "__main__":
    main()
