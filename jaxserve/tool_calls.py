"""Tool calling: the format a model calls tools in (read from its chat template), the grammar that makes it call
one (tool_choice "required" or a named function), and its output parsed into OpenAI's `tool_calls`, whole or as
streamed deltas. Host code; the grammar is enforced by jaxserve.engine.grammar like any other constraint.

Formats:
- "hermes" (Hermes, Qwen 2.5/3: the template mentions `<tool_call>`): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any text before the first is the content.
- "llama3" (Llama 3.1+ JSON tool calling: the template mentions `<|python_tag|>` or the `ipython` role): the whole
  output is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several joined by "; ".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"
# the separators the templates' `tojson` writes (json.dumps' defaults), so a forced call reads like a trained one
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def format_of(template: str | None) -> str | None:
    """The tool-call format of a chat template, or None when it renders no tools."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return None


def grammar_lark(fmt: str, tools: list[dict[str, Any]], choice: str, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with `%json`) of calls to `tools` in format `fmt`: any of them for `choice`
    "required" (one call, or with `parallel` one or more), else one call of the function it names."""
    parallel = parallel and choice == "required"
    names = [t["function"]["name"] for t in tools] if choice == "required" else [choice]
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    key = "arguments" if fmt == "hermes" else "parameters"
    call = {"x-guidance": _JSON_OPTIONS, "anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, key: params[n]}, "required": ["name", key],
         "additionalProperties": False} for n in names]}
    if fmt == "hermes":
        one = '"<tool_call>\\n" call "\\n</tool_call>"'
        body = f"start: {one} (\"\\n\" {one})*" if parallel else f"start: {one}"
    else:
        body = 'start: call ("; " call)*' if parallel else "start: call"
    return f"{body}\ncall: %json {json.dumps(call)}"


def _call(obj: Any, fmt: str) -> dict[str, Any] | None:
    """OpenAI's tool call of one parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {})) if fmt == "hermes" else obj.get("parameters",
                                                                                             obj.get("arguments", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse(fmt: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output. Text that does not parse as calls stays content."""
    if fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES_CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body), fmt)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (text[:start].strip() or None), calls
    stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not stripped.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(stripped):
        try:
            obj, end = decoder.raw_decode(stripped, at)
        except ValueError:
            return text, []
        call = _call(obj, fmt)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(stripped) and stripped[at] in "; \n":
            at += 1
    return None, calls


@dataclass
class ToolStream:
    """One choice's streamed output split into content deltas and OpenAI's tool-call deltas. Content passes as it
    comes until text that may open a call; the calls go out with the choice's last update, once the whole output
    parses, each as OpenAI streams one: a delta with its `index`, id, type and name, then its arguments."""

    fmt: str
    text: str = ""
    sent: int = 0  # characters of `text` passed on as content
    calls: list[dict[str, Any]] = field(default_factory=list)

    def push(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the next piece of text; `final` at the choice's last update."""
        self.text += delta
        if self.fmt == "hermes":
            start = self.text.find("<tool_call>")
            hold = len(self.text) if start >= 0 else _partial_tail(self.text, "<tool_call>")
            content_end = start if start >= 0 else hold
        else:
            lead = self.text.lstrip()
            opens_call = lead.startswith(("{", _PYTHON_TAG)) or (not final and _PYTHON_TAG.startswith(lead))
            content_end = 0 if opens_call and not self.sent else len(self.text)
        if final:
            content, calls = parse(self.fmt, self.text)
            if not calls:
                content_end = len(self.text)
            else:
                content_end = max(self.sent, len(self.text[:self.text.find("<tool_call>")].rstrip())
                                  if self.fmt == "hermes" else 0)
                return self._content(content_end), self._deltas(calls)
        return self._content(content_end), []

    def _content(self, end: int) -> str:
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _deltas(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            out.append({"index": index, "id": call["id"], "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""}})
            out.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
        return out


def _partial_tail(text: str, marker: str) -> int:
    """Where a suffix of `text` that begins `marker` starts (len(text) when none): that much is held back."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)
