"""Constrained decoding on the host: every constraint (JSON schema, regex, choice, Lark grammar) compiled by
llguidance into one grammar, a matcher per constrained request fed the tokens it accepts, and the packed masks of
allowed tokens that a step's sampler applies (jaxserve.model.sampler). No jax here.

A mask is [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32 set when token t is allowed (llguidance's
layout); a row without a constraint has every bit set. docs/structured_output.md says why llguidance rather than
xgrammar, with the measurements, and how the engine keeps its one-step-ahead loop while masks wait for tokens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.errors import InputError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from jaxserve.checkpoint.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Compact JSON (no whitespace between tokens): a small model free to emit whitespace may emit nothing else.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def compile_grammar(kind: str, value: Any) -> str:
    """The llguidance grammar of a constraint: `kind` json_schema (value: a schema object), json_object (value
    ignored), regex (a pattern), choice (a list of strings: exactly one of them) or grammar (Lark, or GBNF/EBNF).
    Raises ValueError with llguidance's message when the constraint is not valid."""
    if kind == "json_object":
        kind, value = "json_schema", {"type": "object"}
    if kind == "json_schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value), _JSON_OPTIONS)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    elif kind == "grammar":
        grammar = llguidance.grammar_from("grammar", value)
    else:
        raise ValueError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.strip())
    return str(grammar)


class Grammars:
    """The served tokenizer as llguidance reads it, and a matcher for each constrained request.

    llguidance's tokenizer is built at the first constrained request (about 0.4 s at a 49k vocabulary, 2 s at 128k),
    not at start: a server that never constrains a request never pays it. Masks of a step's rows are computed
    together by llguidance's executor, on its own threads, outside the GIL."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._lock = threading.Lock()
        self._ll: Any = None
        self._executor: Any = None

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                      eos_token=list(self.tokenizer.eos_token_ids) or None)
                except ValueError as e:
                    raise InputError(f"this model's tokenizer cannot constrain decoding: llguidance cannot read it "
                                     f"({e})") from None
                self._executor = llguidance.LLExecutor()
            return self._ll

    def matcher(self, grammar: str) -> Any:
        """A fresh llguidance matcher of `grammar` (from compile_grammar) at the start of the output."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"the constraint cannot be compiled for this model's tokenizer: {matcher.get_error()}")
        return matcher

    def masks(self, matchers: Sequence[Any | None]) -> np.ndarray:
        """[rows, words] int32: the allowed tokens of each row's matcher; every bit set where the row has none."""
        out = np.full((len(matchers), self.words), -1, np.int32)
        todo = [(m, i) for i, m in enumerate(matchers) if m is not None and not m.is_error()]
        if todo:
            self._ll_tokenizer()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, todo, out)
        return out


def allowed(mask: np.ndarray) -> np.ndarray:
    """The token ids a row of a mask allows (for tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)
