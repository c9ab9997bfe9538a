"""Joins the results files of a job's shards into one (`jaxserve batch merge`).

Each shard must be complete on disk (no torn last line) and no request may be answered twice.
Given the job's input, the merged file follows the input's line order and the merge fails if any
input line has no result; without it, the shards are concatenated in the order given. The merged
file appears atomically (written beside, synced, renamed), so a half-written merge never exists.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from jaxserve.errors import JaxserveError
from jaxserve.jobs.input import custom_id_of, read_lines
from jaxserve.jobs.output import complete_length, iter_records

Key = str | int  # a custom_id, or the input line of an error record that has none


@dataclass
class MergeSummary:
    shards: int
    records: int
    errors: int
    output: str


def merge(shards: list[str], output: str, *, input_path: str | None = None) -> MergeSummary:
    """Writes `output` from the shard files; see the module docstring for the checks."""
    if not shards:
        raise JaxserveError("merge needs at least one shard file")
    if os.path.abspath(output) in {os.path.abspath(s) for s in shards}:
        raise JaxserveError(f"the merge output {output!r} is also one of its shards; write it somewhere else")
    index: dict[Key, tuple[int, int]] = {}  # key -> (shard, byte offset)
    errors = 0
    for i, shard in enumerate(shards):
        _check_complete(shard)
        for number, offset, record in iter_records(shard):
            key: Key = record["custom_id"] if isinstance(record["custom_id"], str) else record["error"]["line"]
            if key in index:
                other = shards[index[key][0]]
                raise JaxserveError(f"{shard}: line {number} answers {_name(key)} again (also in {other}); the shards "
                                    "overlap: were they run with different num_shards or inputs?")
            index[key] = (i, offset)
            errors += record["error"] is not None
    order = _input_order(input_path, index) if input_path is not None else sorted(index, key=index.__getitem__)
    tmp = f"{output}.merging"
    try:
        with contextlib.ExitStack() as stack, open(tmp, "wb") as out:
            files = [stack.enter_context(open(s, "rb")) for s in shards]
            for key in order:
                which, offset = index[key]
                files[which].seek(offset)
                out.write(files[which].readline())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return MergeSummary(len(shards), len(index), errors, output)


def _check_complete(shard: str) -> None:
    try:
        fd = os.open(shard, os.O_RDONLY)
    except OSError as e:
        raise JaxserveError(f"cannot read the shard file {shard!r}: {e.strerror}") from e
    try:
        torn = os.fstat(fd).st_size - complete_length(fd)
    finally:
        os.close(fd)
    if torn:
        raise JaxserveError(f"{shard} ends in a torn line ({torn} bytes): the job writing it was interrupted; rerun "
                            "that shard (it resumes where it stopped) and merge again")


def _input_order(input_path: str, index: dict[Key, tuple[int, int]]) -> list[Key]:
    order: dict[Key, None] = {}  # ordered, and a repeated custom_id is placed once
    missing: list[int] = []
    for number, raw in read_lines(input_path):
        cid = custom_id_of(raw)
        key: Key = cid if cid is not None else number
        if key in index:
            order[key] = None
        else:
            missing.append(number)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise JaxserveError(f"{len(missing)} lines of {input_path} have no result in the shards (lines {shown}); "
                            "rerun the shards that own them (line i belongs to shard (i - 1) % num_shards), then merge")
    if len(order) < len(index):
        extra = next(k for k in index if k not in order)
        raise JaxserveError(f"the shards hold {len(index) - len(order)} results for requests not in {input_path}, "
                            f"e.g. {_name(extra)}; merge the shards of this input only")
    return list(order)


def _name(key: Key) -> str:
    return f"custom_id {key!r}" if isinstance(key, str) else f"the error record of input line {key}"
