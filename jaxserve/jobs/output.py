"""The results file of a batch job: OpenAI batch output lines, appended durably, resumable after a kill.

Every result is one line written by a single append. Results reach the disk (fsync) at least every
`fsync_interval_s`; a kill loses at most the ones not synced yet, and those were never counted as
done, so a restart runs them again: nothing is lost and nothing is written twice. A kill in the
middle of a write leaves a last line without its newline; opening the file cuts it off (it was
never completely written, so its request runs again). An exclusive lock keeps two jobs from
appending to the same file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jaxserve.errors import JaxserveError
from jaxserve.jobs.input import CHAT, BatchRequest
from jaxserve.openai_format import Formatter


def _hex_id(custom_id: str | None, line: int) -> str:
    key = custom_id if custom_id is not None else f"\0line {line}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def result_formatter(item: BatchRequest, prompt_ids: list[int], tokenizer: Any, *, model: str,
                     created: int, tool_format: str | None = None) -> Formatter:
    """What builds a served line's body from its choices' updates: the HTTP API's completions or chat-completions
    body (jaxserve.openai_format), the choices' log-probabilities included when the line asked for them."""
    chat = item.url == CHAT
    n = item.sampling.get("n", 1)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{_hex_id(item.custom_id, item.line)}"
    return Formatter(tokenizer, chat, item.top_logprobs, item.sampling["logprobs"], rid, created, model, n, n,
                     [prompt_ids] * n, prompt_logprobs=item.sampling.get("prompt_logprobs"), tool_format=tool_format)


def result_record(item: BatchRequest, formatter: Formatter) -> dict[str, Any]:
    """The output line of a served request: status 200 and its body."""
    hex_id = _hex_id(item.custom_id, item.line)
    return {"id": f"batch_req_{hex_id}", "custom_id": item.custom_id,
            "response": {"status_code": 200, "body": formatter.response()}, "error": None}


def error_record(line: int, code: str, message: str, custom_id: str | None) -> dict[str, Any]:
    """The output line of a request that was not served; `line` is its input line."""
    return {"id": f"batch_req_{_hex_id(custom_id, line)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line}}


@dataclass
class DoneSet:
    """What a results file already answers: custom_ids, and input lines of errors that had none."""

    ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)

    def add(self, record: dict[str, Any]) -> None:
        cid = record.get("custom_id")
        if isinstance(cid, str):
            self.ids.add(cid)
        elif isinstance(record.get("error"), dict) and isinstance(record["error"].get("line"), int):
            self.lines.add(record["error"]["line"])
        else:
            raise ValueError("a record needs a string custom_id or an error with its input line")

    def has(self, custom_id: str | None, line: int) -> bool:
        return custom_id in self.ids if custom_id is not None else line in self.lines

    def __len__(self) -> int:
        return len(self.ids) + len(self.lines)


def iter_records(path: str) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Yields (line number, byte offset, record) for each complete line of a results file, streaming.

    Bytes after the last newline are a torn write and are not yielded. A complete line that is not
    a record raises: the file is not (only) the output of a batch job.
    """
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return
            try:
                record = json.loads(raw)
                DoneSet().add(record)
            except (ValueError, AttributeError) as e:
                raise JaxserveError(f"{path}: line {number} is not a batch result record ({e}); this file was not written "
                                    "by jaxserve batch, or was edited: point --output at another file") from None
            yield number, offset, record
            offset += len(raw)


def complete_length(fd: int) -> int:
    """The length of an open file up to and including its last newline (what is left after a torn write)."""
    end = os.fstat(fd).st_size
    block = 1 << 16
    while end > 0:
        start = max(0, end - block)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


class ResultsFile:
    """An open, locked results file: `done` holds what it already answers; `append` adds records."""

    def __init__(self, path: str, *, fsync_interval_s: float = 1.0) -> None:
        self.path = path
        self.fsync_interval_s = fsync_interval_s
        self.repaired_bytes = 0  # the torn tail cut off on opening
        parent = os.path.dirname(os.path.abspath(path))
        created = not os.path.exists(path)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise JaxserveError(f"cannot open the batch output {path!r}: {e.strerror}") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise JaxserveError(f"{path} is locked by another running jaxserve batch; give each job (and each shard) "
                                "its own output file") from None
        try:
            self.done = self._load()
        except BaseException:
            os.close(self._fd)
            raise
        if created:
            _fsync_dir(parent)
        self._unsynced = False
        self._last_sync = time.monotonic()

    def _load(self) -> DoneSet:
        size, complete = os.fstat(self._fd).st_size, complete_length(self._fd)
        if size > complete:
            os.ftruncate(self._fd, complete)
            os.fsync(self._fd)
            self.repaired_bytes = size - complete
        done = DoneSet()
        for _, _, record in iter_records(self.path):
            done.add(record)
        return done

    def append(self, records: list[dict[str, Any]]) -> None:
        """Appends records (one write) and syncs them if the last sync is `fsync_interval_s` old."""
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        for record in records:
            self.done.add(record)
        self._unsynced = True
        if time.monotonic() - self._last_sync >= self.fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        if self._unsynced:
            os.fsync(self._fd)
            self._unsynced = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync_dir(path: str) -> None:
    """Makes a new file's directory entry durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
