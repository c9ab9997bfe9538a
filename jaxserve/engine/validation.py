"""The request checks of every surface (gRPC, HTTP, batch lines), in one place.

Each surface maps its request onto these calls, passing the names its callers use for the fields;
each failure is an `InvalidArgument` whose message names that field and its value, so a caller can
fix it without reading code. Everything here runs before any tokenization or engine work that the
request's size could make expensive: sizes are checked in bytes first.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxserve import tool_calls
from jaxserve.config import SamplingParams
from jaxserve.engine.batch import MAX_LOGIT_BIAS
from jaxserve.engine.grammar import compile_grammar
from jaxserve.errors import InputError

DEFAULT_MAX_TOKENS = 64
MAX_REQUEST_ID_BYTES = 256
MAX_STOP_BYTES = 1024  # one stop string
MAX_SEED = 2**32 - 1  # seeds key the sampler as uint32
MAX_N = 16  # samples of one prompt
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty|, OpenAI's range
MAX_BIAS = 100.0  # |logit_bias| values, OpenAI's range
MAX_CONSTRAINT_BYTES = 65536  # a structured-output constraint as JSON text: a schema, regex, choices or grammar
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# Roles a chat may use; a template may know more, which it names as string literals (`Limits.roles`).
CHAT_ROLES = ("system", "user", "assistant", "tool")


class InvalidArgument(InputError):
    """A request field that can never be served as sent (INVALID_ARGUMENT over gRPC, 400 over HTTP)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What the served model and the server accept."""

    vocab_size: int
    context_length: int  # the model's
    max_sequence_length: int  # one engine slot's
    max_tokens_limit: int
    max_stop_strings: int
    max_logprobs: int
    max_prompt_bytes: int  # a prompt's UTF-8 bytes, or all of a chat's contents together
    max_messages: int
    roles: tuple[str, ...] = CHAT_ROLES

    @classmethod
    def of(cls, engine: Any, server: Any) -> Limits:
        """The limits of `engine` (a jaxserve Engine) under `server`'s (a ServerConfig's) request limits."""
        return cls(vocab_size=engine.vocab_size, context_length=engine.context_len,
                   max_sequence_length=engine.cfg.max_seq_len, max_tokens_limit=server.max_tokens_limit,
                   max_stop_strings=server.max_stop_strings, max_logprobs=min(20, engine.cfg.max_logprobs),
                   max_prompt_bytes=server.prompt_bytes_limit(engine.cfg.max_seq_len), max_messages=server.max_messages)

    @property
    def room(self) -> int:
        """Tokens one sequence may hold: prompt plus output."""
        return min(self.context_length, self.max_sequence_length)


def request_id(value: str, name: str = "request_id") -> str:
    """The caller's request id, bounded: it is echoed on every chunk."""
    size = len(value.encode())
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(f"{name} is {size} bytes; at most {MAX_REQUEST_ID_BYTES} (or leave it empty: the server "
                              f"makes one)")
    return value


def prompt_text(text: Any, limits: Limits, name: str = "prompt") -> str:
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"{name}={_show(text)} must be a non-empty string")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise InvalidArgument(f"{name} is {size} bytes; at most {limits.max_prompt_bytes} (max_prompt_bytes)")
    return text


def token_ids(ids: Any, limits: Limits, name: str = "token_ids") -> list[int]:
    if not isinstance(ids, Sequence) or isinstance(ids, str) or not ids:
        raise InvalidArgument(f"{name}={_show(ids)} must be a non-empty list of token ids")
    if len(ids) > limits.room:
        raise InvalidArgument(f"{name} has {len(ids)} tokens; this server holds at most {limits.room} per sequence")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise InvalidArgument(f"{name}[{i}]={_show(t)} is outside the vocabulary [0, {limits.vocab_size})")
    return list(ids)


def messages(value: Any, limits: Limits, name: str = "messages") -> list[dict[str, Any]]:
    """Chat messages as [{"role", "content"}], each role one the template knows, the contents within the prompt bytes.
    An assistant message may carry OpenAI's `tool_calls` (content then may be empty), a tool message its
    `tool_call_id` and `name`: they pass to the template as `transformers` passes them (each call's arguments as an
    object)."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise InvalidArgument(f"{name}={_show(value)} must be a non-empty list of {{role, content}} messages")
    if len(value) > limits.max_messages:
        raise InvalidArgument(f"{name} has {len(value)} messages; at most {limits.max_messages}")
    size = 0
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise InvalidArgument(f"{name}[{i}]={_show(m)} must be a {{role, content}} object")
        role, content = m.get("role"), m.get("content")
        if role not in limits.roles:
            raise InvalidArgument(f"{name}[{i}].role={_show(role)} is not one of {', '.join(limits.roles)}")
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise InvalidArgument(f"{name}[{i}].content={_show(content)} must be a string")
        size += len(content.encode("utf-8", "surrogatepass"))
        message: dict[str, Any] = {"role": role, "content": content}
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise InvalidArgument(f"{name}[{i}].{key}={_show(m[key])} must be a string")
                message[key] = m[key]
                size += len(m[key].encode("utf-8", "surrogatepass"))
        if m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{name}[{i}].tool_calls")
            size += len(json.dumps(message["tool_calls"]).encode())
        out.append(message)
    if size > limits.max_prompt_bytes:
        raise InvalidArgument(f"{name} contents are {size} bytes; at most {limits.max_prompt_bytes} (max_prompt_bytes)")
    return out


def sampling(limits: Limits, *, max_tokens: Any = None, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
             seed: Any = 0, stop: Any = (), stop_token_ids: Any = (), ignore_eos: Any = False, logprobs: Any = 0,
             presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0, repetition_penalty: Any = 1.0, min_p: Any = 0.0,
             logit_bias: Any = None, min_tokens: Any = 0, n: Any = 1, prompt_logprobs: Any = None, speculate: Any = None,
             names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from a request's values, each checked; `names` maps a parameter to the surface's field name
    (default: the parameter's own)."""

    def name(key: str) -> str:
        return (names or {}).get(key, key)

    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits.max_tokens_limit:
        raise InvalidArgument(f"{name('max_tokens')}={_show(max_tokens)} must be between 1 and {limits.max_tokens_limit}")
    if not _is_number(temperature) or not 0 <= temperature < math.inf:  # NaN fails both
        raise InvalidArgument(f"{name('temperature')}={_show(temperature)} must be a finite number >= 0 (0 is greedy)")
    if not _is_int(top_k) or top_k < 0:
        raise InvalidArgument(f"{name('top_k')}={_show(top_k)} must be an integer >= 0 (0 disables it)")
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"{name('top_p')}={_show(top_p)} must be in (0, 1]")
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise InvalidArgument(f"{name('seed')}={_show(seed)} must be an integer in [0, {MAX_SEED}]")
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument(f"{name('stop')}={_show(stop)} must be a string or a list of strings")
    if len(stop) > limits.max_stop_strings:
        raise InvalidArgument(f"{name('stop')} has {len(stop)} strings; at most {limits.max_stop_strings} are allowed")
    for i, s in enumerate(stop):
        if not s or len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            raise InvalidArgument(f"{name('stop')}[{i}]={_show(s)} must have 1 to {MAX_STOP_BYTES} bytes")
    if not isinstance(stop_token_ids, Sequence) or len(stop_token_ids) > limits.max_stop_strings:
        raise InvalidArgument(f"{name('stop_token_ids')}={_show(stop_token_ids)} must be a list of at most "
                              f"{limits.max_stop_strings} token ids")
    for i, t in enumerate(stop_token_ids):
        if not _is_int(t) or not 0 <= t < limits.vocab_size:
            raise InvalidArgument(f"{name('stop_token_ids')}[{i}]={_show(t)} is outside the vocabulary "
                                  f"[0, {limits.vocab_size})")
    if not isinstance(ignore_eos, bool):
        raise InvalidArgument(f"{name('ignore_eos')}={_show(ignore_eos)} must be true or false")
    if not _is_int(logprobs) or not 0 <= logprobs <= limits.max_logprobs:
        raise InvalidArgument(f"{name('logprobs')}={_show(logprobs)} must be between 0 and {limits.max_logprobs}")
    for key, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(f"{name(key)}={_show(value)} must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}] "
                                  "(0 disables it)")
    if not _is_number(repetition_penalty) or not 0 < repetition_penalty < math.inf:
        raise InvalidArgument(f"{name('repetition_penalty')}={_show(repetition_penalty)} must be a finite number > 0 "
                              "(1 disables it)")
    if not _is_number(min_p) or not 0.0 <= min_p <= 1.0:
        raise InvalidArgument(f"{name('min_p')}={_show(min_p)} must be in [0, 1] (0 disables it)")
    if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise InvalidArgument(f"{name('min_tokens')}={_show(min_tokens)} must be between 0 and "
                              f"{name('max_tokens')}={max_tokens}")
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise InvalidArgument(f"{name('n')}={_show(n)} must be between 1 and {MAX_N}")
    if prompt_logprobs is not None and (not _is_int(prompt_logprobs) or not 0 <= prompt_logprobs <= limits.max_logprobs):
        raise InvalidArgument(f"{name('prompt_logprobs')}={_show(prompt_logprobs)} must be between 0 and "
                              f"{limits.max_logprobs} (or absent)")
    if speculate is not None and not isinstance(speculate, bool):
        raise InvalidArgument(f"{name('speculate')}={_show(speculate)} must be true, false or absent (the server's "
                              "default)")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                          seed=seed, stop=tuple(stop), stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                          logprobs=logprobs, presence_penalty=float(presence_penalty),
                          frequency_penalty=float(frequency_penalty), repetition_penalty=float(repetition_penalty),
                          min_p=float(min_p), logit_bias=_logit_bias(logit_bias, limits, name("logit_bias")),
                          min_tokens=min_tokens, n=n, prompt_logprobs=prompt_logprobs, speculate=speculate)


def _logit_bias(value: Any, limits: Limits, name: str) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or, as JSON keys, decimal strings), or (id, bias) pairs -> sorted pairs."""
    if value is None:
        return ()
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, Sequence) or isinstance(items, str) or len(items) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"{name}={_show(value)} must map at most {MAX_LOGIT_BIAS} token ids to biases")
    out = {}
    for item in items:
        if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 2:
            raise InvalidArgument(f"{name} entry {_show(item)} must be a (token id, bias) pair")
        token, bias = item
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if not _is_int(token) or not 0 <= token < limits.vocab_size:
            raise InvalidArgument(f"{name} token id {_show(token)} is outside the vocabulary [0, {limits.vocab_size})")
        if not _is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise InvalidArgument(f"{name}[{token}]={_show(bias)} must be a number in [-{MAX_BIAS}, {MAX_BIAS}]")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _tool_calls(value: Any, name: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool calls -> [{"id", "type": "function", "function": {"name", "arguments":
    object}}] (arguments come as a JSON string; templates render the object)."""
    if not isinstance(value, list):
        raise InvalidArgument(f"{name}={_show(value)} must be a list of tool calls")
    out = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(f"{name}[{i}]={_show(call)} must be {{id, type: function, function: {{name, "
                                  "arguments}}}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as e:
                raise InvalidArgument(f"{name}[{i}].function.arguments={_show(arguments)} is not JSON: {e}") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def tools(value: Any, choice: Any, limits: Limits, parallel: Any = None) -> tuple[list[dict[str, Any]], str]:
    """OpenAI's `tools` and `tool_choice` -> (the tools as [{"type": "function", "function": {"name", "description"?,
    "parameters"}}], the choice: "none", "auto", "required" or the name of the function to call). No tools: ([],
    "none"); tools without a choice: "auto"."""
    if value is None or value == []:
        if choice not in (None, "none", "auto"):
            raise InvalidArgument(f"tool_choice={_show(choice)} needs tools")
        return [], "none"
    if not isinstance(value, list):
        raise InvalidArgument(f"tools={_show(value)} must be a list of {{type: function, function: {{name, ...}}}}")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidArgument(f"tools[{i}]={_show(tool)} must be {{type: function, function: {{name, description, "
                                  "parameters}}}}")
        fname = function.get("name")
        if not isinstance(fname, str) or not _TOOL_NAME.fullmatch(fname):
            raise InvalidArgument(f"tools[{i}].function.name={_show(fname)} must be 1 to 64 letters, digits, _ or -")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters={_show(parameters)} must be a JSON schema object")
        entry = {"name": fname, "parameters": parameters}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        out.append({"type": "function", "function": entry})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"tools name a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    size = len(json.dumps(out).encode())
    if size > limits.max_prompt_bytes:
        raise InvalidArgument(f"tools are {size} bytes; at most {limits.max_prompt_bytes} (max_prompt_bytes)")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument(f"parallel_tool_calls={_show(parallel)} must be true or false")
    if choice is None:
        return out, "auto"
    if choice in ("none", "auto", "required"):
        return out, choice
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise InvalidArgument(f"tool_choice={_show(choice)} must be none, auto, required or {{type: function, "
                              "function: {name}}}")
    if named not in names:
        raise InvalidArgument(f"tool_choice names {named!r}, which is not one of the tools ({', '.join(names)})")
    return out, named


Constraint = tuple[str, Any, str]  # (kind, value, the field that sent it): what `constraint` compiles


def tool_calling(tool_list: list[dict[str, Any]], choice: str, parallel: Any,
                 template: str | None) -> tuple[str | None, Constraint | None]:
    """(the format to parse the output's tool calls in, or None; the constraint that makes it call a tool, for
    tool_choice "required" or a named function) of a chat's `tools` (from `tools`) under the model's template."""
    if not tool_list:
        return None, None
    fmt = tool_calls.format_of(template)
    if fmt is None:
        raise InvalidArgument("tools: this model's chat template renders no tools in a format jaxserve parses "
                              f"({' or '.join(tool_calls.FORMATS)}); send the request without tools")
    if choice in ("none", "auto"):
        return (fmt if choice == "auto" else None), None
    return fmt, ("grammar", tool_calls.grammar_lark(fmt, tool_list, choice, parallel is not False), "tool_choice")


def requested_constraint(response_format: Any, structured_outputs: Any,
                         tool_constraint: Constraint | None = None) -> Constraint | None:
    """The one constraint a request asks for: OpenAI's `response_format`, vLLM's `structured_outputs` ({"json" |
    "regex" | "choice" | "grammar" | "json_object": ...}), or the tool calls tool_choice requires; None if none."""
    found: list[Constraint] = []
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        spec = response_format.get("json_schema") if kind == "json_schema" else None
        if kind == "json_schema":
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidArgument(f"response_format.json_schema={_show(spec)} must be {{name, schema, strict}}")
            found.append(("json_schema", spec["schema"], "response_format.json_schema.schema"))
        elif kind == "json_object":
            found.append(("json_object", None, "response_format"))
        elif kind != "text":
            raise InvalidArgument(f"response_format.type={_show(kind)} must be text, json_object or json_schema")
    if structured_outputs is not None:
        forms = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                 "json_object": "json_object"}
        keys = [k for k in forms if isinstance(structured_outputs, dict) and structured_outputs.get(k) not in (None, False)]
        unknown = sorted(set(structured_outputs) - set(forms)) if isinstance(structured_outputs, dict) else []
        if len(keys) != 1 or unknown:
            raise InvalidArgument(f"structured_outputs={_show(structured_outputs)} must hold exactly one of "
                                  f"{', '.join(forms)}")
        found.append((forms[keys[0]], structured_outputs[keys[0]], f"structured_outputs.{keys[0]}"))
    if tool_constraint is not None:
        found.append(tool_constraint)
    if len(found) > 1:
        raise InvalidArgument(f"{' and '.join(f[2] for f in found)} each constrain the output; send one")
    return found[0] if found else None


def constraint(kind: str, value: Any, name: str) -> str:
    """The llguidance grammar of a structured-output constraint (jaxserve.engine.grammar.compile_grammar): `kind`
    json_schema (a schema object, or its JSON text), json_object, regex, choice (a list of strings) or grammar
    (Lark or EBNF text), sent in the field `name`. Its size is checked before it is compiled."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidArgument(f"{name}={_show(value)} is not valid JSON: {e}") from None
    if kind == "json_schema" and not isinstance(value, dict):
        raise InvalidArgument(f"{name}={_show(value)} must be a JSON schema object")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise InvalidArgument(f"{name}={_show(value)} must be a non-empty string")
    if kind == "choice" and (not isinstance(value, list) or not value or
                             not all(isinstance(c, str) and c for c in value)):
        raise InvalidArgument(f"{name}={_show(value)} must be a non-empty list of non-empty strings")
    size = len(json.dumps(value).encode()) if kind != "json_object" else 0
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(f"{name} is {size} bytes; at most {MAX_CONSTRAINT_BYTES}")
    try:
        return compile_grammar(kind, value)
    except ValueError as e:
        what = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}.get(kind, kind)
        raise InvalidArgument(f"{name} is not a valid {what} here: {_show(str(e), 300)}") from None


def fits(num_prompt: int, params: SamplingParams, limits: Limits, max_tokens_name: str = "max_tokens") -> None:
    """Prompt plus max_tokens must fit the model's context and one engine slot."""
    need = num_prompt + params.max_tokens
    if need > limits.room:
        raise InvalidArgument(
            f"the prompt of {num_prompt} tokens plus {max_tokens_name}={params.max_tokens} is {need} tokens, "
            f"more than the {limits.room} this server holds per sequence; shorten the prompt or lower {max_tokens_name}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _show(value: Any, width: int = 60) -> str:
    """repr(value), cut to `width` characters: an error message never echoes a huge input."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"
