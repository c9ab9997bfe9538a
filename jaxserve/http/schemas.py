"""OpenAI's request shapes for completions and chat, as pydantic models (responses are built as plain dicts).

An unknown top-level field is ignored with one warning line naming it, as vLLM does (clients send fields of
newer API versions); a known field jaxserve does not implement yet is a 400 unless it holds the value that means
"off", so that no caller gets other outputs than it asked for without knowing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Known to OpenAI's API but not implemented here: accepted only at the value that turns them off.
OFF_VALUES: dict[str, Any] = {"best_of": None, "suffix": None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: see the module docstring

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's
    ignore_eos: bool = False  # vLLM's
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = 1.0  # vLLM's
    min_p: float = 0.0  # vLLM's
    min_tokens: int = 0  # vLLM's
    prompt_logprobs: int | None = None  # vLLM's: each choice then carries `prompt_logprobs`
    speculate: bool | None = None  # jaxserve's: speculative decoding on or off for this request (absent: the server's)
    # not implemented: see OFF_VALUES
    best_of: int | None = None
    # structured output (jaxserve.engine.grammar): OpenAI's {"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {name, schema, strict}}, or vLLM's {"json" | "regex" | "choice" | "grammar": ...}; one of them
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # chat only (jaxserve.tool_calls)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[str]:
        """The fields set to something jaxserve does not do yet."""
        return [name for name, off in OFF_VALUES.items() if name in type(self).model_fields and getattr(self, name) != off]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, each {id, type, function}

    def as_dict(self) -> dict[str, Any]:
        """The message as validation.messages takes it."""
        extra = {k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id),
                                   ("tool_calls", self.tool_calls)) if v is not None}
        return {"role": self.role, "content": self.text(), **extra}

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt or chat messages."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(min_length=1)
