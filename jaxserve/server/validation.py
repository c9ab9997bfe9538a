"""Turns a GenerateRequest into prompt ids and SamplingParams, or says exactly which field is wrong.

Everything here runs before the engine sees the request. Each failure is an `InvalidArgument`
whose message names the proto field and its value, so a caller can fix it without reading code.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import SamplingParams
from jaxserve.errors import InputError
from jaxserve.v1 import inference_pb2 as pb

DEFAULT_MAX_TOKENS = 64


class InvalidArgument(InputError):
    """A request field that can never be served as sent (answered with INVALID_ARGUMENT)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What the served model and the server accept."""

    vocab_size: int
    context_length: int  # the model's
    max_sequence_length: int  # one engine slot's
    max_tokens_limit: int
    max_stop_strings: int
    max_logprobs: int


def prompt_ids(input_kind: str | None, request: pb.GenerateRequest | pb.TokenizeRequest, tokenizer: Tokenizer,
               vocab_size: int) -> list[int]:
    """The token ids of the request's input (`prompt`, `token_ids` or `messages`)."""
    if input_kind is None:
        raise InvalidArgument("the request has no input: set one of prompt, token_ids or messages")
    if input_kind == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt='' is empty; send some text")
        ids = tokenizer.encode(request.prompt)
    elif input_kind == "token_ids":
        assert isinstance(request, pb.GenerateRequest)
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids.ids is empty; send at least one token id")
        bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids.ids[{bad[0]}]={bad[1]} is outside the vocabulary [0, {vocab_size})")
    else:
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise InvalidArgument("messages.messages is empty; send at least one message")
        for i, m in enumerate(messages):
            if not m["role"]:
                raise InvalidArgument(f"messages.messages[{i}].role='' is empty; use e.g. 'user'")
        ids = tokenizer.encode_chat(messages)
    if not ids:
        raise InvalidArgument(f"{input_kind} encodes to zero tokens; send a non-empty input")
    return ids


def sampling_params(request: pb.GenerateRequest, limits: Limits) -> SamplingParams:
    """Checks every sampling field against the limits and builds the engine's SamplingParams."""
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise InvalidArgument(f"sampling.max_tokens={max_tokens} must be between 1 and {limits.max_tokens_limit}")
    if not s.temperature >= 0:  # also catches NaN
        raise InvalidArgument(f"sampling.temperature={s.temperature} must be >= 0 (0 is greedy)")
    if s.top_k < 0:
        raise InvalidArgument(f"sampling.top_k={s.top_k} must be >= 0 (0 disables it)")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p={top_p} must be in (0, 1]")
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"sampling.stop has {len(s.stop)} strings; at most {limits.max_stop_strings} are allowed")
    empty = next((i for i, text in enumerate(s.stop) if not text), None)
    if empty is not None:
        raise InvalidArgument(f"sampling.stop[{empty}]='' is empty; stop strings must have at least one character")
    bad = next(((i, t) for i, t in enumerate(s.stop_token_ids) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"sampling.stop_token_ids[{bad[0]}]={bad[1]} is outside the vocabulary [0, {limits.vocab_size})")
    if not 0 <= s.logprobs <= limits.max_logprobs:
        raise InvalidArgument(f"sampling.logprobs={s.logprobs} must be between 0 and {limits.max_logprobs}")
    return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=top_p, seed=s.seed,
                          stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs)


def check_length(num_prompt: int, params: SamplingParams, limits: Limits) -> None:
    """Prompt plus max_tokens must fit the model's context and one engine slot."""
    need = num_prompt + params.max_tokens
    room = min(limits.context_length, limits.max_sequence_length)
    if need > room:
        raise InvalidArgument(
            f"the prompt of {num_prompt} tokens plus sampling.max_tokens={params.max_tokens} is {need} tokens, "
            f"more than the {room} this server holds per sequence; shorten the prompt or lower max_tokens"
        )
