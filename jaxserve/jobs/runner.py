"""A batch job: stream the input through one engine and append each result as it finishes.

The job runs on one thread, which is also the engine thread (it calls `Engine.step`). Before every
step it tops the engine up to `in_flight_limit` requests, reading, parsing and tokenizing input
lines as it goes, so memory stays bounded however long the input is, while the scheduler always
has waiting requests to take a slot the moment one frees (continuous batching). After every step it
drains the requests' updates and appends the finished ones, in the order they finish.

A step that raises stops the job with that error: the requests in flight get no record, so a
restart runs them again.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from tqdm import tqdm

from jaxserve.config import BatchConfig, ServerConfig
from jaxserve.engine import validation
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request
from jaxserve.errors import InputError, JaxserveError
from jaxserve.jobs.input import BatchRequest, LineError, in_shard, parse_line, read_lines, scan_input
from jaxserve.jobs.output import ResultsFile, error_record, result_formatter, result_record
from jaxserve.openai_format import Formatter


def shard_output(path: str, shard_index: int, num_shards: int) -> str:
    """The results file of one shard: `{shard_index}`/`{num_shards}` in `path` are filled in; without them,
    a job of several shards inserts `.shard-00003-of-00008` before the extension."""
    if "{shard_index" in path or "{num_shards" in path:
        return path.format(shard_index=shard_index, num_shards=num_shards)
    if num_shards == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.shard-{shard_index:05d}-of-{num_shards:05d}{ext}"


@dataclass
class Line:
    """A line in flight: its requests (its n samples) and the body their updates build."""

    item: BatchRequest
    requests: list[Request]
    formatter: Formatter
    left: int  # samples not finished yet
    error: str | None = None  # the first sample's engine error: the line's record


@dataclass
class Summary:
    """What one run of a job did (`completed` and `errors` count this run's new records only)."""

    input: str
    output: str
    shard_index: int
    num_shards: int
    lines: int  # input lines in this shard
    already_done: int  # answered by an earlier run
    completed: int  # served, status 200
    errors: int  # error records: malformed lines, rejected requests, engine errors
    prompt_tokens: int
    output_tokens: int
    wall_s: float  # from the first request to the last result (model loading and compilation excluded)
    repaired_bytes: int  # a torn last line cut off on opening

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return (self.completed + self.errors) / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s, "requests_per_s": self.requests_per_s}

    def text(self) -> str:
        """A few lines for people."""
        left = self.lines - self.already_done - self.completed - self.errors
        return (f"shard {self.shard_index}/{self.num_shards} of {self.input} -> {self.output}\n"
                f"  {self.lines} requests: {self.completed} completed and {self.errors} errors in this run, "
                f"{self.already_done} done before, {left} left\n"
                f"  {self.output_tokens} output tokens ({self.prompt_tokens} prompt) in {self.wall_s:.1f} s: "
                f"{self.output_tokens_per_s:.1f} output tokens/s, {self.requests_per_s:.2f} requests/s")


class BatchJob:
    """One shard of a job: opening it checks the input and repairs the output before any work starts."""

    def __init__(self, cfg: BatchConfig, *, shard_index: int) -> None:
        if cfg.input is None or cfg.output is None:
            raise JaxserveError(f"a batch job needs an input and an output file, got input={cfg.input!r} and "
                                f"output={cfg.output!r}; set them in the config or with --input/--output")
        if not 0 <= shard_index < cfg.num_shards:
            raise JaxserveError(f"shard_index={shard_index} must lie in [0, num_shards={cfg.num_shards})")
        self.cfg = cfg
        self.input = cfg.input
        self.shard_index = shard_index
        self.output = shard_output(cfg.output, shard_index, cfg.num_shards)
        if not os.path.isfile(self.input):
            raise JaxserveError(f"the batch input {self.input!r} does not exist or is not a file")
        existed = os.path.exists(self.output)
        self.results = ResultsFile(self.output, fsync_interval_s=cfg.fsync_interval_s)
        try:
            self.scan = scan_input(self.input, shard_index, cfg.num_shards, self.results.done.has)
            self.scan.check_unique(self.input)
        except BaseException:
            self.results.close()
            if not existed and os.path.getsize(self.output) == 0:
                os.remove(self.output)
            raise

    @property
    def todo(self) -> int:
        """Requests of this shard without a result yet."""
        return self.scan.todo

    def _pending(self) -> Iterator[BatchRequest | LineError]:
        """This shard's lines without a result, parsed, streaming."""
        n, done = self.cfg.num_shards, self.results.done
        for number, raw in read_lines(self.input):
            if not in_shard(number, self.shard_index, n):
                continue
            try:
                item: BatchRequest | LineError = parse_line(raw, number, self.cfg.sampling)
            except LineError as e:
                item = e
            if not done.has(item.custom_id, number):
                yield item

    def run(self, engine: Engine, model: str, *, progress_file: TextIO | None = None) -> Summary:
        """Runs every pending request of the shard through `engine`; `model` names it in the records."""
        stats = Summary(self.input, self.output, self.shard_index, self.cfg.num_shards, self.scan.lines,
                        self.scan.lines - self.scan.todo, 0, 0, 0, 0, 0.0, self.results.repaired_bytes)
        out = progress_file or sys.stderr
        bar = tqdm(total=self.todo, unit="req", desc=f"shard {self.shard_index}", file=out, dynamic_ncols=True,
                   disable=not self.cfg.progress, mininterval=0.5 if out.isatty() else 30.0, smoothing=0.05)
        created = int(time.time())
        limits = validation.Limits.of(engine, ServerConfig())  # a server's default request limits
        in_flight: dict[str, tuple[Line, int]] = {}  # request id -> its line, its sample's index
        pending = self._pending()
        exhausted = False
        start = time.perf_counter()
        tokens_seen = 0
        try:
            while True:
                records = []
                while not exhausted and len(in_flight) < self.cfg.in_flight_limit:
                    item = next(pending, None)
                    if item is None:
                        exhausted = True
                    elif isinstance(item, LineError):
                        records.append(error_record(item.line, item.code, str(item), item.custom_id))
                    else:
                        try:
                            line = self._submit(engine, item, limits, model, created)
                        except Exception as e:  # the line's own failure: validation, template, tokenizer, engine
                            if engine.fault is not None:
                                raise
                            message = str(e) if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
                            records.append(error_record(item.line, "invalid_request", f"line {item.line}: {message}",
                                                        item.custom_id))
                        else:
                            for index, request in enumerate(line.requests):
                                in_flight[request.request_id] = (line, index)
                if in_flight:
                    engine.step()
                for request_id, (line, index) in list(in_flight.items()):
                    box = engine.outbox(request_id)
                    request = line.requests[index]
                    while not box.empty():
                        update = box.get_nowait()
                        tokens_seen += len(update.token_ids)
                        line.formatter.add(index, request, update)
                        if update.finish_reason is None:
                            continue
                        del in_flight[request_id]
                        engine.close_outbox(request_id)
                        line.left -= 1
                        line.error = line.error or update.error
                        if line.left:
                            continue
                        item = line.item
                        if line.error is not None:
                            records.append(error_record(item.line, "engine_error", f"line {item.line}: {line.error}",
                                                        item.custom_id))
                        else:
                            records.append(result_record(item, line.formatter))
                            stats.prompt_tokens += len(request.prompt_ids)
                            stats.output_tokens += sum(len(r.output_ids) for r in line.requests)
                self.results.append(records)
                for r in records:
                    if r["error"] is None:
                        stats.completed += 1
                    else:
                        stats.errors += 1
                if records:
                    bar.update(len(records))
                    bar.set_postfix_str(f"{tokens_seen / max(time.perf_counter() - start, 1e-9):.1f} tok/s",
                                        refresh=False)
                if exhausted and not in_flight:
                    break
        finally:
            stats.wall_s = time.perf_counter() - start
            self.results.sync()
            bar.close()
        return stats

    @staticmethod
    def _submit(engine: Engine, item: BatchRequest, limits: validation.Limits, model: str, created: int) -> Line:
        """Submits a line's samples; a line whose engine submission fails halfway cancels what it submitted."""
        tools, tool_format, grammar = item.tool_calling(limits, engine.tokenizer.chat_template)
        ids = item.prompt_ids(engine.tokenizer, limits, tools)
        params = item.params(limits, grammar)
        validation.fits(len(ids), params, limits)
        requests: list[Request] = []
        try:
            for child in params.children():
                requests.append(engine.submit(ids, child))
        except Exception:
            for r in requests:
                engine.cancel(r.request_id)
                engine.close_outbox(r.request_id)
            raise
        return Line(item, requests, result_formatter(item, ids, engine.tokenizer, model=model, created=created,
                                                     tool_format=tool_format), len(requests))

    def close(self) -> None:
        self.results.close()

    def __enter__(self) -> BatchJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
