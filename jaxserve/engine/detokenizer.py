"""Incremental detokenization: stream text as tokens arrive, never half a UTF-8 character."""

from __future__ import annotations

from jaxserve.checkpoint.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `decode(all ids)`.

    It decodes a short window (from the last emitted boundary) instead of the whole sequence, and
    holds text back while it ends in U+FFFD, i.e. while a multi-byte character is still incomplete.
    Decoding relative to a prefix keeps tokenizers that strip a leading space (SentencePiece) right.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[prefix:read] were already emitted
        self._read = 0

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Returns whatever is held back (an incomplete character becomes U+FFFD)."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]
