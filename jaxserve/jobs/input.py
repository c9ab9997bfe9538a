"""Input lines of a batch job, parsed into requests or into errors that carry their line number.

Two forms are read, one JSON object a line:

- the OpenAI batch format: `{"custom_id", "method": "POST", "url": "/v1/completions" or
  "/v1/chat/completions", "body": {...}}`, the body as the OpenAI API takes it;
- a plain form: `{"custom_id", "prompt": ...}` or `{"custom_id", "messages": [...]}`, with any body
  key beside them.

A completions prompt is a string or a list of token ids; chat messages are rendered with the
model's chat template. Sampling keys a line leaves out come from the job's defaults; every sampling field
the HTTP API takes is read (penalties, min_p, logit_bias, min_tokens, n, logprobs, prompt_logprobs), and so are
structured output (response_format, structured_outputs) and, on chat lines, tools and tool_choice. A line that
asks for something jaxserve cannot honour (streaming, best_of, echo) is an error, never silently served
otherwise. Blank lines are skipped; line numbers count every physical line from 1.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import SamplingParams
from jaxserve.engine import validation
from jaxserve.errors import JaxserveError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

_ENVELOPE = {"custom_id", "method", "url", "body"}
_INT_KEYS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "top_k": "top_k", "seed": "seed"}
# passed to validation.sampling as they are
_SAMPLING_KEYS = ("temperature", "top_p", "stop", "ignore_eos", "stop_token_ids", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "n", "prompt_logprobs",
                  "speculate")
_IGNORED_KEYS = ("model", "user")  # accepted and not used: the job serves one model
_DEFAULT_ONLY = {"best_of": 1, "stream": False, "echo": False}  # accepted only at these values
# structured output (both urls) and tool calling (chat): kept as sent, checked and compiled when the line is submitted
_STRUCTURED_KEYS = ("response_format", "structured_outputs")
_TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


class LineError(JaxserveError):
    """An input line that cannot be served; it becomes an error record and the job goes on."""

    def __init__(self, line: int, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.code = code
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchRequest:
    """One parsed input line: its fields as sent, checked against the served model's limits when it is submitted
    (`prompt_ids`, `params`), by the checks every surface shares (jaxserve.engine.validation)."""

    line: int
    custom_id: str
    url: str  # COMPLETIONS or CHAT
    prompt: Any  # completions: text or token ids
    messages: Any  # chat: [{role, content}]
    sampling: dict[str, Any]  # SamplingParams' fields, the job's defaults where the line leaves them out
    # log-probabilities the result shows: completions' `logprobs` (top k), chat's `logprobs` with `top_logprobs`
    logprobs: int = 0
    top_logprobs: int = 0
    structured: dict[str, Any] = field(default_factory=dict)  # _STRUCTURED_KEYS and _TOOL_KEYS the line sent

    def tool_calling(self, limits: validation.Limits, template: str | None) -> tuple[list[dict[str, Any]], str | None,
                                                                                      str | None]:
        """(the tools for the template, the format its tool calls are parsed in, the grammar the output follows)
        of the line's tools, tool_choice, response_format and structured_outputs (the HTTP API's rules)."""
        s = self.structured
        tools, choice = validation.tools(s.get("tools"), s.get("tool_choice"), limits, s.get("parallel_tool_calls"))
        tool_format, tool_constraint = validation.tool_calling(tools, choice, s.get("parallel_tool_calls"), template)
        requested = validation.requested_constraint(s.get("response_format"), s.get("structured_outputs"),
                                                    tool_constraint)
        return tools, tool_format, None if requested is None else validation.constraint(*requested)

    def prompt_ids(self, tokenizer: Tokenizer, limits: validation.Limits,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids: encoded text, the ids as given, or the rendered chat (given `tools`)."""
        if self.messages is not None:
            chat = validation.messages(self.messages, limits)
            return tokenizer.encode_chat(chat, max_bytes=2 * limits.max_prompt_bytes, tools=tools or None)
        if isinstance(self.prompt, str):
            text = validation.prompt_text(self.prompt, limits)
            return tokenizer.encode(text)
        return validation.token_ids(self.prompt, limits, "prompt")

    def params(self, limits: validation.Limits, grammar: str | None = None) -> SamplingParams:
        values = {k: v for k, v in self.sampling.items() if k != "grammar"}  # (a job's defaults hold no constraint)
        return dataclasses.replace(validation.sampling(limits, **values), grammar=grammar)


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """Yields (line number, raw line) for every non-blank line of `path`, streaming."""
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield number, raw
    except OSError as e:
        raise JaxserveError(f"cannot read the batch input {path!r}: {e.strerror}") from e


def in_shard(line: int, shard_index: int, num_shards: int) -> bool:
    """Line i (from 1) belongs to shard (i - 1) % num_shards, so shards are even and need no line count."""
    return (line - 1) % num_shards == shard_index


def custom_id_of(raw: bytes) -> str | None:
    """The line's custom_id when it is a JSON object with a string one, else None (a cheap pre-pass read)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


@dataclass
class InputScan:
    """One pass over the whole input, before any work: this shard's size and every repeated custom_id."""

    lines: int  # non-blank lines in this shard
    todo: int  # of them, those without a result yet
    duplicates: dict[str, list[int]]  # custom_id -> the lines it occurs on, for every id seen twice

    def check_unique(self, path: str) -> None:
        """Raises, naming them and their lines, if any custom_id occurs twice: results could not be told apart."""
        if self.duplicates:
            shown = "; ".join(f"{cid!r} on lines {', '.join(map(str, lines))}"
                              for cid, lines in list(self.duplicates.items())[:10])
            more = f" (and {len(self.duplicates) - 10} more)" if len(self.duplicates) > 10 else ""
            raise JaxserveError(f"{path}: {len(self.duplicates)} custom_ids occur more than once: {shown}{more}; every "
                                "custom_id must be unique so that each result can be matched to its request; nothing was run")


def scan_input(path: str, shard_index: int = 0, num_shards: int = 1,
               is_done: Callable[[str | None, int], bool] = lambda cid, line: False) -> InputScan:
    """Reads every line once (all shards: a custom_id must be unique across them); keeps only ids, not lines."""
    seen: set[str] = set()
    repeated: set[str] = set()
    lines = todo = 0
    for number, raw in read_lines(path):
        cid = custom_id_of(raw)
        if cid is not None:
            if cid in seen:
                repeated.add(cid)
            seen.add(cid)
        if in_shard(number, shard_index, num_shards):
            lines += 1
            todo += not is_done(cid, number)
    del seen
    duplicates: dict[str, list[int]] = {}  # in the order of their first line
    if repeated:
        for number, raw in read_lines(path):
            cid = custom_id_of(raw)
            if cid in repeated:
                duplicates.setdefault(cid, []).append(number)
    return InputScan(lines, todo, duplicates)


def parse_line(raw: bytes, line: int, defaults: SamplingParams) -> BatchRequest:
    """Parses one line; raises LineError (with the custom_id when it was readable) if it cannot be served."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise LineError(line, "invalid_json", f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise LineError(line, "invalid_json", f"expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError(line, "invalid_request", f"custom_id={cid!r} must be a non-empty string")
    try:
        url, body = _envelope(obj)
        sampling = _sampling(body, url, cid, defaults)
        shown = {"logprobs": sampling["logprobs"], "top_logprobs": body.get("top_logprobs") or 0,
                 "structured": {k: body[k] for k in (*_STRUCTURED_KEYS, *_TOOL_KEYS) if body.get(k) is not None}}
        if url == COMPLETIONS and any(k in shown["structured"] for k in _TOOL_KEYS):
            raise JaxserveError(f"tools and tool_choice are for {CHAT!r} lines")
        if url == COMPLETIONS:
            return BatchRequest(line, cid, url, _prompt(body), None, sampling, **shown)
        return BatchRequest(line, cid, url, None, _messages(body), sampling, **shown)
    except JaxserveError as e:
        raise LineError(line, "invalid_request", str(e), cid) from None


def _envelope(obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if not ({"url", "body", "method"} & obj.keys()):  # the plain form: the body's keys beside custom_id
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        return (CHAT if "messages" in body else COMPLETIONS), body
    unknown = sorted(obj.keys() - _ENVELOPE)
    if unknown:
        raise JaxserveError(f"unknown keys {unknown} beside custom_id, method, url and body")
    if obj.get("method", "POST") != "POST":
        raise JaxserveError(f"method={obj['method']!r} must be 'POST'")
    url = obj.get("url")
    if url not in (COMPLETIONS, CHAT):
        raise JaxserveError(f"url={url!r} must be {COMPLETIONS!r} or {CHAT!r}")
    envelope_body = obj.get("body")
    if not isinstance(envelope_body, dict):
        raise JaxserveError(f"body must be a JSON object, got {type(envelope_body).__name__}")
    return url, envelope_body


def _sampling(body: dict[str, Any], url: str, cid: str, defaults: SamplingParams) -> dict[str, Any]:
    """The line's sampling fields by SamplingParams' names over the job's defaults; their values are checked with the
    model's limits when the line is submitted."""
    prompt_key = "prompt" if url == COMPLETIONS else "messages"
    values: dict[str, Any] = {}
    for key, value in body.items():
        if key == prompt_key or key in _IGNORED_KEYS or value is None or key in _STRUCTURED_KEYS + _TOOL_KEYS:
            continue
        if key in _INT_KEYS:
            values[_INT_KEYS[key]] = value
        elif key in _SAMPLING_KEYS:
            values[key] = value
        elif key == "logprobs":  # completions: how many top alternatives; chat: whether, with top_logprobs
            values[key] = value if url == COMPLETIONS else (max(1, body.get("top_logprobs") or 0) if value else 0)
        elif key == "top_logprobs" and url == CHAT:
            if value and not body.get("logprobs"):
                raise JaxserveError("top_logprobs needs logprobs: true")
        elif key in _DEFAULT_ONLY:
            if value != _DEFAULT_ONLY[key]:
                raise JaxserveError(f"{key}={value!r} is not supported by jaxserve batch; leave it out or set it to "
                                    f"{json.dumps(_DEFAULT_ONLY[key])}")
        else:
            known = sorted({prompt_key, "logprobs", *_INT_KEYS, *_SAMPLING_KEYS, *_IGNORED_KEYS, *_DEFAULT_ONLY}
                           | ({"top_logprobs"} if url == CHAT else set()))
            raise JaxserveError(f"body key {key!r} is not supported; jaxserve batch reads {', '.join(known)}")
    if "seed" not in values:  # reproducible per request, and independent across requests
        values["seed"] = (defaults.seed + zlib.crc32(cid.encode())) % 2**32
    return {**dataclasses.asdict(defaults), **values}


def _prompt(body: dict[str, Any]) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
        raise JaxserveError(f"prompt is a list of {len(prompt)} strings; send one prompt per line")
    return prompt


def _messages(body: dict[str, Any]) -> Any:
    messages = body.get("messages")
    if isinstance(messages, list):
        return [{**m, "content": _content(m.get("content"), i)} if isinstance(m, dict) else m
                for i, m in enumerate(messages)]
    return messages


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "\n".join(p["text"] for p in content)
    raise JaxserveError(f"messages[{i}].content must be a string or a list of text parts "
                        "({\"type\": \"text\", \"text\": ...}); other parts are not supported")
