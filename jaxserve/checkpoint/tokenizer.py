"""Tokenizers built on Hugging Face `tokenizers`, from GGUF metadata or a `tokenizer.json`.

Chat templates are rendered by jinja2 in an immutable sandbox: a template ships inside a model
file, so it is untrusted input.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from jaxserve.errors import CheckpointError, InputError

log = logging.getLogger(__name__)

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`; the GPT-2 pattern is ByteLevel's own.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_PATTERNS = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
_GPT2_PRE = ("default", "gpt2", "gpt-2", "smollm")

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types that must never be split


@dataclass
class Tokenizer:
    """Text <-> token ids, the special ids generation needs, and the chat template."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token/eos_token strings for templates

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                    max_bytes: int | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """Renders `messages` ([{"role", "content"}, with tool calls and results as `transformers` passes them]) with
        the model's chat template, at most `max_bytes` of it; `tools` (OpenAI's function tools) reach the template
        as `tools`, as `transformers`' apply_chat_template passes them."""
        if not self.chat_template:
            raise InputError("this model has no chat template; send a plain prompt instead of chat messages")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)

        def raise_exception(message: str) -> None:
            raise InputError(f"chat template rejected the messages: {message}")

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(self.chat_template)
            text = template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                                   **self.special_tokens)
        except InputError:
            raise
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as e:
            # the template's own failure on these messages: one line, no traceback (a recursion's is ~1,400 lines)
            raise InputError(f"chat template failed to render these messages: {type(e).__name__}: {e}") from None
        if max_bytes is not None and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
            raise InputError(f"the chat template rendered more than {max_bytes} bytes (max_prompt_bytes)")
        return text

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, max_bytes: int | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a rendered chat; the template itself places any BOS token.

        Only the template makes control tokens: a special token's string inside a message's content tokenizes as
        plain text. Such a chat is rendered with a placeholder for each content; the template's text between them
        is encoded as usual, each content with special tokens split (so a template that edits the content, say
        trims it, does not edit these). A chat without such strings is rendered and encoded whole, as
        `transformers` does."""
        specials = [t for t in self.backend.get_added_tokens_decoder().values() if t.special]
        if not any(t.content in m["content"] for m in messages for t in specials):
            return self.encode(self.render_chat(messages, max_bytes=max_bytes, tools=tools), add_special_tokens=False)
        marks = [f"\x00{uuid.uuid4().hex}\x00" for _ in messages]
        rendered = self.render_chat([{**m, "content": mark} for m, mark in zip(messages, marks)], max_bytes=max_bytes,
                                    tools=tools)
        ids: list[int] = []
        for i, mark in enumerate(marks):
            head, found, rendered = rendered.partition(mark)
            if not found:
                raise InputError(f"the chat template dropped or changed messages[{i}].content; it cannot be "
                                 f"rendered safely with special-token strings in it")
            ids += self.encode(head, add_special_tokens=False) if head else []
            ids += self._plain_text.encode(messages[i]["content"], add_special_tokens=False).ids
        return ids + (self.encode(rendered, add_special_tokens=False) if rendered else [])

    @functools.cached_property
    def _plain_text(self) -> tokenizers.Tokenizer:
        """The tokenizer with special-token strings split like any other text (for message contents)."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def save(self, directory: str) -> None:
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        meta = {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
                "chat_template": self.chat_template, "special_tokens": self.special_tokens}
        with open(os.path.join(directory, "tokenizer_meta.json"), "w") as f:
            json.dump(meta, f)

    @classmethod
    def load_saved(cls, directory: str) -> Tokenizer:
        """Loads what `save` wrote."""
        with open(os.path.join(directory, "tokenizer_meta.json")) as f:
            meta = json.load(f)
        backend = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        return cls(backend, meta["bos_token_id"], tuple(meta["eos_token_ids"]), meta["chat_template"],
                   meta["special_tokens"])


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    """Builds the tokenizer of GGUF `tokenizer.ggml.*` metadata: byte-level BPE ('gpt2') or SentencePiece ('llama')."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(
            f"{source}: tokenizer model {kind!r} is not supported; jaxserve reads byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') GGUF tokenizers. Convert the model from a Hugging Face directory with "
            "tokenizer.json instead."
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError(f"{source}: the GGUF metadata has no tokenizer.ggml.tokens; the file carries no tokenizer")
    backend = _byte_level_bpe(meta, tokens, source) if kind == "gpt2" else _sentencepiece_bpe(meta, tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    backend.add_special_tokens(specials)

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = tuple(dict.fromkeys(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                          "tokenizer.ggml.eom_token_id") if k in meta))
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:  # llama.cpp's defaults
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    special_strings = {"bos_token": tokens[bos] if bos is not None else "",
                       "eos_token": tokens[eos] if eos is not None else ""}
    return Tokenizer(backend, bos, eos_ids, meta.get("tokenizer.chat_template"), special_strings)


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 2, Mistral, Gemma, Phi-3) as `tokenizers` runs it: spaces as "▁", a
    merge for every piece that two pieces make (the merged piece's score its rank), unknown bytes as <0xNN> pieces."""
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((piece[:k], piece[k:]) for piece in vocab for k in range(1, len(piece))
                     if piece[:k] in vocab and piece[k:] in vocab),
                    key=lambda m: (-scores[vocab[m[0] + m[1]]], vocab[m[0]], vocab[m[1]]))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if unk is None else tokens[unk],
                                              fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.normalizer = normalizers.Sequence([*([normalizers.Prepend("▁")] if prefix else []),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return backend


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                              ignore_merges=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLIT_PATTERNS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(_SPLIT_PATTERNS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _GPT2_PRE:
            log.warning("%s: unknown pre-tokenizer %r; using the GPT-2 split pattern", source, pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def tokenizer_from_hf_dir(directory: str) -> Tokenizer:
    """Loads `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) from a HF directory."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{directory}: no tokenizer.json; jaxserve needs the fast-tokenizer file beside the weights")
    backend = tokenizers.Tokenizer.from_file(path)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    generation = _read_json(os.path.join(directory, "generation_config.json"))
    model_config = _read_json(os.path.join(directory, "config.json"))

    def token_str(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    bos_str, eos_str = token_str(config.get("bos_token")), token_str(config.get("eos_token"))
    bos = backend.token_to_id(bos_str) if bos_str else model_config.get("bos_token_id")
    eos_ids: list[int] = []
    for source in (generation.get("eos_token_id"), model_config.get("eos_token_id"),
                   backend.token_to_id(eos_str) if eos_str else None):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and i not in eos_ids:
                eos_ids.append(int(i))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template is None and os.path.exists(os.path.join(directory, "chat_template.jinja")):
        with open(os.path.join(directory, "chat_template.jinja")) as f:
            template = f.read()
    return Tokenizer(backend, bos, tuple(eos_ids), template,
                     {"bos_token": bos_str or "", "eos_token": eos_str or ""})


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return dict(json.load(f))
