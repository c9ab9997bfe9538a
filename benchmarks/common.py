"""Result records for benchmarks/results/*.jsonl (one JSON object per measurement)."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any


def device_name() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}"


def record(path: str, benchmark: str, config: dict[str, Any], metric: str, value: float, unit: str,
           baseline: str | None = None, baseline_value: float | None = None, higher_is_better: bool = True) -> dict:
    """Appends one measurement; with a baseline, `ratio` is how many times better ours is."""
    import jax

    row: dict[str, Any] = {"benchmark": benchmark, "device": device_name(), "jax_version": jax.__version__,
                           "date": datetime.date.today().isoformat(), "config": config, "metric": metric,
                           "value": value, "unit": unit}
    if baseline is not None and baseline_value:
        row.update(baseline=baseline, baseline_value=baseline_value,
                   ratio=value / baseline_value if higher_is_better else baseline_value / value)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row
