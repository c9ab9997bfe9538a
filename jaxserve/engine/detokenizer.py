"""Incremental detokenization: stream text as tokens arrive, never half a UTF-8 character."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:  # the engine imports no jax; jaxserve.checkpoint does
    from jaxserve.checkpoint.tokenizer import Tokenizer



class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `decode(all ids)`.

    Each token takes one step of the tokenizers library's `DecodeStream`, which decodes a short window
    relative to its prefix (so tokenizers that strip a leading space, as SentencePiece does, stay right) and
    holds text back while a multi-byte character is incomplete: 0.6 us a token against 2.5 us for decoding
    the window and its prefix in Python (two decodes), which an engine step pays for each of its hundreds
    of rows. `flush` decodes what is still held back the same way, once.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read]: the last delta's tokens (the window `flush` decodes relative to)
        self._read = 0  # ids before this were emitted

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        text = self._stream.step(self._tokenizer.backend, token_id)
        if text is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text

    def flush(self) -> str:
        """Returns whatever is held back (an incomplete character becomes U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]
