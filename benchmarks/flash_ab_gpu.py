"""The flash kernel against an earlier version of itself and against cuDNN, alternated in one process.

Kernel changes of a few percent are smaller than the spread between machines (cuDNN's own rate moves by
up to 10 %), so a change is judged against the kernel it replaces, timed in turn with it on the same
GPU. The earlier version is a copy of `pallas_kernels/flash_attention/mosaic_gpu.py` from a revision:

    git show REV:pallas_kernels/flash_attention/mosaic_gpu.py > .ab/flash_base.py   # .ab/ is git-ignored
    PYTHONPATH=. python3 benchmarks/flash_ab_gpu.py --baseline .ab/flash_base.py [--seqs 4096,8192]

Shapes as `kernels_gpu.py`: bfloat16, head_dim 128, 16 heads, batch · seq = 16k tokens. Each round times
cuDNN, the baseline and ours; the best of `--rounds` rounds is kept for each. That is done on `--placements`
copies of the inputs at different addresses (where they lie moves every kernel by up to 10 %, and not always
equally); each ratio is reported at its median placement. Rows: `flash_attention_ab` (ours against the
baseline) and `flash_attention` (ours against cuDNN) in results/kernels_gpu.jsonl.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import kernels_gpu as kg  # noqa: E402
from benchmarks.common import record  # noqa: E402
from pallas_kernels.flash_attention import mosaic_gpu as ours_module  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("flash_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="a copy of flash_attention/mosaic_gpu.py from another revision")
    ap.add_argument("--label", default="", help="what the baseline is, for the rows (e.g. its revision)")
    ap.add_argument("--seqs", default="2048,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--placements", type=int, default=5, help="copies of the inputs at different addresses (odd: "
                    "each ratio is then one placement's)")
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu.jsonl")
    args = ap.parse_args()
    if args.placements < 1 or args.rounds < 1:
        ap.error(f"--placements ({args.placements}) and --rounds ({args.rounds}) must be at least 1")
    base_module = load_module(args.baseline)
    print(f"{jax.devices()[0]} jax {jax.__version__}; baseline {args.baseline} {args.label}", flush=True)
    table = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        problem = kg.flash_problem(seq)
        q = problem[0]
        b, _, heads, hd = q.shape
        copies = kg.placed_copies(problem, args.placements)
        for causal in (True, False):
            flops = kg.flash_flops(q, causal)
            fns = {
                "cudnn": kg.cudnn_attention(causal),
                "baseline": jax.jit(lambda q, k, v, c=causal: base_module.flash_attention(q, k, v, causal=c)),
                "ours": jax.jit(lambda q, k, v, c=causal: ours_module.flash_attention(q, k, v, causal=c)),
            }
            placed = kg.rates_over_placements(fns, copies, flops, args.rounds)  # TFLOP/s, kernel by placement
            err = kg.rel_err(fns["ours"](*problem), fns["cudnn"](*problem))
            config = dict(batch=b, seq=seq, heads=heads, head_dim=hd, causal=causal, dtype="bfloat16",
                          err_vs_cudnn=err, rounds=args.rounds, baseline_file=args.label or args.baseline,
                          placements=args.placements,
                          placement_tflops=[{name: round(t, 1) for name, t in tf.items()} for tf in placed],
                          k_addresses=kg.buffer_addresses(copies))
            vs_base, vs_cudnn, base_cudnn = (kg.median_placement(placed, num, den) for num, den in
                                             (("ours", "baseline"), ("ours", "cudnn"), ("baseline", "cudnn")))
            record(args.out, "flash_attention_ab", config, "throughput", vs_base["ours"], "TFLOP/s", "previous kernel",
                   vs_base["baseline"])
            record(args.out, "flash_attention", config, "throughput", vs_cudnn["ours"], "TFLOP/s", "cudnn",
                   vs_cudnn["cudnn"])
            line = (f"s={seq:5d} causal={causal!s:5}  median placement: ours/baseline "
                    f"{vs_base['ours'] / vs_base['baseline']:5.3f}  ours/cudnn {vs_cudnn['ours'] / vs_cudnn['cudnn']:5.3f}"
                    f"  baseline/cudnn {base_cudnn['baseline'] / base_cudnn['cudnn']:5.3f}  (ours "
                    + " ".join(f"{tf['ours']:.0f}" for tf in placed) + f" TFLOP/s)  err {err:.1e}")
            print(line, flush=True)
            table.append(line)
        del copies
    print("\n".join(table))


if __name__ == "__main__":
    main()
