"""OpenAI's completion and chat-completion bodies, whole or as streamed chunks, built from the engine's updates of
each choice: the HTTP API's responses and the batch job's result lines are the same bodies."""

from __future__ import annotations

from typing import Any

from jaxserve.tool_calls import ToolStream, parse

# A token's logprobs entry: (id, its log-probability, the top alternatives); an echoed prompt's first token has
# neither.
Entry = tuple[int, float | None, list[tuple[int, float]] | None]


class Formatter:
    """Builds OpenAI's response bodies (whole, or one streamed chunk at a time) from the children's updates."""

    def __init__(self, tok: Any, chat: bool, top: int, logprobs: int, rid: str, created: int, model: str, n: int,
                 n_per_prompt: int, prompt_ids: list[list[int]], *, echo: bool = False, prompt_only: bool = False,
                 prompt_logprobs: int | None = None, tool_format: str | None = None):
        self.tok, self.chat, self.top, self.logprobs, self.n_per_prompt = tok, chat, top, logprobs, n_per_prompt
        self.rid, self.created, self.model = rid, created, model
        # echo: each choice's prompt ids, put before its text (and, with logprobs, its entries: the prompt's own
        # log-probabilities, none for the first token); prompt_only: echo with max_tokens 0, whose one generated
        # token is dropped; prompt_logprobs: vLLM's field, each choice's `prompt_logprobs`
        self.prompt_ids, self.echo, self.prompt_only, self.prompt_logprobs_k = prompt_ids, echo, prompt_only, \
            prompt_logprobs
        self.prompt_entries: list[list | None] = [None] * n
        self.echoed = [False] * n
        self.text = [""] * n
        self.lps: list[list[Entry]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.prompt_tokens = [0] * n
        self.cached_tokens = [0] * n
        self.completion_tokens = [0] * n
        self.sent_role = [False] * n
        # a chat with tools: each choice's text is parsed for tool calls in this format (jaxserve.tool_calls)
        self.tool_format = tool_format
        self.tool_streams = [ToolStream(tool_format) for _ in range(n)] if tool_format else []

    def add(self, index: int, request: Any, update: Any) -> None:
        if update.prompt_logprobs is not None:
            self.prompt_entries[index] = update.prompt_logprobs
        self.prompt_tokens[index] = len(request.prompt_ids)
        self.cached_tokens[index] = request.cached_tokens
        if update.finish_reason is not None:
            self.finish[index] = update.finish_reason
        if self.prompt_only:
            return
        self.text[index] += update.text
        self.lps[index] += self._entries(update)
        self.completion_tokens[index] = len(request.output_ids)

    @staticmethod
    def _entries(update: Any) -> list[Entry]:
        return [(t, chosen, tops) for t, (chosen, tops) in zip(update.token_ids, update.logprobs)]

    def _echo(self, index: int) -> tuple[str, list[Entry]]:
        """The prompt's text and logprobs entries that echo puts first in choice `index`."""
        ids = self.prompt_ids[index]
        entries = self.prompt_entries[index] or [None] * len(ids)
        return (self._decode(ids), [(t, e[0] if e else None, e[1] if e else None) for t, e in zip(ids, entries)])

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False)) if self.tok is not None else ""

    def _prompt_logprobs(self, index: int) -> Any:
        """vLLM's `prompt_logprobs` of a choice: None for the first token, then {id: {logprob, decoded_token}} of the
        prompt token and the top alternatives."""
        entries = self.prompt_entries[index]
        if entries is None:
            return None
        ids = self.prompt_ids[index]
        out: list[Any] = []
        for p, entry in enumerate(entries):
            if entry is None:
                out.append(None)
                continue
            logprob, tops = entry
            pairs = [(ids[p], logprob), *tops]
            out.append({str(t): {"logprob": lp, "decoded_token": self._token(t)} for t, lp in pairs})
        return out

    def _token(self, token: int) -> str:
        return str(self.tok.decode([token], skip_special_tokens=False)) if self.tok is not None else str(token)

    def _logprobs(self, entries: list[Entry], offset: int = 0) -> Any:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [{"token": self._token(t), "logprob": lp, "bytes": list(self._token(t).encode()),
                                 "top_logprobs": [{"token": self._token(i), "logprob": v,
                                                   "bytes": list(self._token(i).encode())} for i, v in (tops or [])[:self.top]]}
                                for t, lp, tops in entries]}
        tokens = [self._token(t) for t, _, _ in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if tops is None else {self._token(i): v for i, v in tops[:self.logprobs]}
                                 for _, _, tops in entries], "text_offset": offsets}

    def usage(self) -> dict[str, Any]:
        # each prompt counted once (its n choices share it), every choice's output
        firsts = range(0, len(self.prompt_tokens), self.n_per_prompt)
        prompt = sum(self.prompt_tokens[i] for i in firsts)
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens[i] for i in firsts)}}

    def response(self) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(self.text):
            finish = self.finish[i]
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tool_format:
                    content, calls = parse(self.tool_format, text)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message, "logprobs": self._logprobs(self.lps[i]),
                                "finish_reason": finish})
            else:
                entries = self.lps[i]
                if self.echo:
                    echoed, prompt_entries = self._echo(i)
                    text, entries = echoed + text, prompt_entries + entries
                choices.append({"index": i, "text": text, "logprobs": self._logprobs(entries), "finish_reason": finish})
            if self.prompt_logprobs_k is not None:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(i)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    def chunk(self, index: int, update: Any) -> dict[str, Any]:
        entries = [] if self.prompt_only else self._entries(update)
        text = "" if self.prompt_only else update.text
        if self.chat:
            delta: dict[str, Any] = {"content": update.text}
            finish = update.finish_reason
            if self.tool_format:
                stream = self.tool_streams[index]
                delta["content"], calls = stream.push(update.text, finish is not None)
                if calls:
                    delta["tool_calls"] = calls
                if stream.calls and finish == "stop":
                    finish = "tool_calls"
            if not self.sent_role[index]:
                delta["role"] = "assistant"
                self.sent_role[index] = True
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(entries), "finish_reason": finish}
        else:
            if self.echo and not self.echoed[index]:  # the prompt comes first, in the choice's first chunk
                self.echoed[index] = True
                echoed, prompt_entries = self._echo(index)
                text, entries = echoed + text, prompt_entries + entries
            choice = {"index": index, "text": text, "logprobs": self._logprobs(entries),
                      "finish_reason": update.finish_reason}
        if self.prompt_logprobs_k is not None and update.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(index)
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}
