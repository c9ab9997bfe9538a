"""`jaxserve batch` and `jaxserve batch merge`: the command line of batch jobs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from jaxserve.errors import JaxserveError

log = logging.getLogger("jaxserve")

SHARD_ENV = "JOB_COMPLETION_INDEX"  # set by a Kubernetes Indexed Job in each pod

_HELP = {
    "input": "OpenAI batch JSONL (or {custom_id, prompt} lines) to run",
    "output": "results JSONL, appended to and resumed from; per shard when num_shards > 1",
    "model": "GGUF file, HF or orbax directory (default: the embedded SmolLM2-135M)",
    "dtype": "float32 or bfloat16 (default: float32 on CPU, bfloat16 on GPU/TPU)",
    "shard_index": f"this shard, in [0, num_shards) (default: ${SHARD_ENV}, else 0)",
    "num_shards": "how many shards split the input (input line i goes to shard (i - 1) %% num_shards)",
    "max_in_flight": "requests handed to the engine at once (default: 4 * max_slots)",
    "fsync_interval_s": "sync results to disk at least this often (0: after every step)",
    "progress": "show a progress bar on stderr",
}


def add_parser(sub: Any) -> None:
    """Adds `batch` (and its `merge`) to the CLI's subcommands."""
    from jaxserve.config import BatchConfig
    from jaxserve.jobs.flags import add_config_flags

    batch = sub.add_parser("batch", help="run an offline batch job from a config file (OpenAI batch JSONL in and out)",
                           description="Runs every request of the input through the engine and appends one result "
                                       "line per request to the output; a rerun resumes. Flags override the config.")
    batch.add_argument("--config", default=None, help="BatchConfig YAML, e.g. configs/batch.yaml")
    add_config_flags(batch, BatchConfig, help_for=_HELP)
    batch.set_defaults(func=cmd_batch)
    merge = batch.add_subparsers(dest="batch_command").add_parser(
        "merge", help="join the shards' results files into one",
        description="Joins shard results files; with --input, in input order and checking that every line has a result.")
    merge.add_argument("--output", dest="merge_output", metavar="OUTPUT", required=True, help="the merged results file")
    merge.add_argument("--input", dest="merge_input", metavar="INPUT", default=None,
                       help="the job's input: order the results as its lines and fail if any line has none")
    merge.add_argument("shards", nargs="+", metavar="SHARD", help="results files of the shards")
    merge.set_defaults(func=cmd_merge)


def shard_index_from(env: Mapping[str, str]) -> int:
    """The shard a pod runs when the config names none: its Indexed Job completion index, else 0."""
    value = env.get(SHARD_ENV)
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise JaxserveError(f"{SHARD_ENV}={value!r} is not an integer; set --shard-index instead") from None


def _stop_on_sigterm() -> None:
    """SIGTERM (a pod being evicted) ends the job through its `finally` blocks, which sync the results."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def cmd_batch(args: argparse.Namespace) -> int:
    from jaxserve import launch
    from jaxserve.config import BatchConfig, load_yaml
    from jaxserve.jobs.flags import overrides_from, with_overrides
    from jaxserve.jobs.runner import BatchJob, Summary

    cfg = load_yaml(BatchConfig, args.config) if args.config else BatchConfig()
    cfg = with_overrides(cfg, overrides_from(args))
    launch.join(args, cfg.distributed)
    if launch.is_follower():  # a follower of a multi-host group runs the leader's steps; the leader owns the files
        launch.engine_or_follow(launch.load_model(cfg.model, dtype=cfg.dtype, quantize=cfg.quantize,
                                                  engine=cfg.engine), cfg.engine)
        return 0
    shard_index = cfg.shard_index if cfg.shard_index is not None else shard_index_from(os.environ)
    _stop_on_sigterm()
    with BatchJob(cfg, shard_index=shard_index) as job:
        if job.results.repaired_bytes:
            log.warning("%s: cut off a torn last line of %d bytes (its request runs again)", job.output,
                        job.results.repaired_bytes)
        if job.todo == 0:
            summary = Summary(job.input, job.output, shard_index, cfg.num_shards, job.scan.lines, job.scan.lines, 0, 0,
                              0, 0, 0.0, job.results.repaired_bytes)
        else:
            from jaxserve.runner import release_followers

            engine, name = _engine(cfg)
            try:
                summary = job.run(engine, name, progress_file=sys.stderr)
            finally:
                release_followers(engine)
    print(summary.text(), file=sys.stderr)
    print(json.dumps(summary.to_dict()), flush=True)
    return 0


def _engine(cfg: Any) -> tuple[Any, str]:
    from jaxserve import launch

    start = time.perf_counter()
    model = launch.load_model(cfg.model, dtype=cfg.dtype, quantize=cfg.quantize, engine=cfg.engine)
    engine = launch.engine_or_follow(model, cfg.engine)
    log.info("loaded %s and compiled its engine in %.1f s", model.source, time.perf_counter() - start)
    return engine, os.path.basename(model.source.rstrip("/"))


def cmd_merge(args: argparse.Namespace) -> int:
    from jaxserve.jobs.merge import merge

    summary = merge(args.shards, args.merge_output, input_path=args.merge_input)
    print(f"merged {summary.records} results ({summary.errors} errors) from {summary.shards} shards into "
          f"{summary.output}", file=sys.stderr)
    return 0
