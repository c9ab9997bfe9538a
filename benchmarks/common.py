"""Shared by the benchmarks: result records (benchmarks/results/*.jsonl, one JSON object a row) and timing."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_bench(flags: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> dict[str, Any]:
    """`jaxserve bench FLAGS --json` in a process of its own (the device's memory to itself): its JSON result. A
    failure ends the benchmark with the bench's output."""
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", *flags, "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"jaxserve bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def dispatched_back_to_back(runner: Any, inp: Any, steps: int) -> tuple[float, float]:
    """(host seconds to enqueue a step, seconds a step) of `steps` engine steps of `inp` dispatched back to back
    through `runner` (a jaxserve StepRunner) and waited on once at the end, after one untimed step."""
    import time

    runner.dispatch(inp)()
    start = time.perf_counter()
    results = [runner.dispatch(inp) for _ in range(steps)]
    enqueued = time.perf_counter()
    results[-1]()
    return (enqueued - start) / steps, (time.perf_counter() - start) / steps


def decode_input(rows: int, context: int, pages_per_slot: int, vocab: int) -> Any:
    """One decode step's StepInput for `rows` slots, each `context` tokens in, over distinct pages."""
    import numpy as np

    from jaxserve.engine.batch import StepInput

    inp = StepInput.build([None] * rows, 1, pages_per_slot, rows)
    inp.tokens[:] = np.random.default_rng(0).integers(0, vocab, (rows, 1), dtype=np.int32)
    inp.slots[:] = np.arange(rows, dtype=np.int32)
    inp.positions[:] = context
    inp.valid[:] = True
    inp.page_table[:] = np.arange(rows * pages_per_slot, dtype=np.int32).reshape(rows, pages_per_slot)
    inp.prompt_len[:] = context + 1
    return inp


def record(path: str, benchmark: str, config: dict[str, Any], metric: str, value: float, unit: str,
           baseline: str | None = None, baseline_value: float | None = None, higher_is_better: bool = True) -> dict:
    """Appends one measurement; with a baseline, `ratio` is how many times better ours is."""
    import jax

    d = jax.devices()[0]
    row: dict[str, Any] = {"benchmark": benchmark, "device": f"{d.platform}:{getattr(d, 'device_kind', '')}",
                           "jax_version": jax.__version__,
                           "date": datetime.date.today().isoformat(), "config": config, "metric": metric,
                           "value": value, "unit": unit}
    if baseline is not None and baseline_value:
        row.update(baseline=baseline, baseline_value=baseline_value,
                   ratio=value / baseline_value if higher_is_better else baseline_value / value)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def print_rows(rows: list[dict], keys: tuple[str, ...] = ()) -> None:
    """Recorded rows as a table: benchmark, the config's `keys`, metric, value and unit, then baseline and ratio."""
    for r in rows:
        config = " ".join(f"{k}={r['config'][k]}" for k in keys if k in r["config"])
        vs = f" {r['baseline_value']:>11.4g} {r['ratio']:>7.3f}x  {r['baseline']}" if "ratio" in r else ""
        print(f"{r['benchmark']:<38} {config:<36} {r['metric']:<34} {r['value']:>11.4g} {r['unit']:<8}{vs}", flush=True)


def timed(fn: Any, *args: Any, reps: int = 5, inner: int = 1) -> float:
    """Median seconds per call: `inner` back-to-back calls per timing, after a warm-up call."""
    import time

    import jax
    import numpy as np

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return float(np.median(times))


def repeated(fn: Any, n: int) -> Any:
    """One jit running fn n times, each call's first input depending on the last output, so device
    time is measured without the host's per-call dispatch (inside a model step there is none)."""
    import jax
    import jax.numpy as jnp

    def run(x: Any, *rest: Any) -> Any:
        def body(i: Any, carry: Any) -> Any:
            return fn(x + (carry[:, :1] * 0).astype(x.dtype), *rest).astype(carry.dtype)

        out = jax.eval_shape(fn, x, *rest)
        return jax.lax.fori_loop(0, n, body, jnp.zeros(out.shape, jnp.float32))

    return jax.jit(run)


class ClockLog:
    """Samples the GPU's SM clock (and what holds it back) with nvidia-smi every `period` seconds while the `with`
    block runs: kernels bound by the SM's own work (the int8 products) slow down with the clock where
    bandwidth-bound ones do not, so a ratio between the two should carry the clocks it ran at. `summary()` is None
    where nvidia-smi is missing or gave nothing."""

    def __init__(self, period: float = 1.0):
        import threading

        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import subprocess

        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks_throttle_reasons.active",
                                      "--format=csv,noheader,nounits", "--id=0"], capture_output=True, text=True,
                                     timeout=10, check=True).stdout
                mhz, reasons = (field.strip() for field in out.strip().splitlines()[0].split(","))
                self.samples.append((int(mhz), reasons))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return
            self._stop.wait(self.period)

    def __enter__(self) -> ClockLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any] | None:
        mhz = [m for m, _ in self.samples]
        return {"sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz), "samples": len(mhz),
                "throttle_reasons": sorted({r for _, r in self.samples})} if mhz else None
