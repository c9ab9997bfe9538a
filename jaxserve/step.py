"""The step functions the engine's runner compiles (jaxserve.runner): a forward over a bucket of rows, the device
state it carries between steps, and the packed input the host sends it.

A step's rows are prefill chunks, decode rows or speculative verify rows; its KV cache is donated, so XLA updates
the pages in place. Sampling beyond the greedy token runs after the step, in jaxserve.model.sampler.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.batch import NUM_TOP, StepInput
from jaxserve.model.attention import AttentionFn
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.sampler import (
    commit,
    greedy,
    prompt_logprobs,
)
from jaxserve.model.transformer import decode_stacked, forward, head_logits
from jaxserve.model.weights import Weights
from pallas_kernels.decode_megakernel import StackedLayers

log = logging.getLogger(__name__)

class DeviceState(NamedTuple):
    """What the device keeps between steps; donated to every step."""

    cache: Any  # KVCache; with EngineConfig.decode_megakernel (k, v), every layer's pages stacked (stacked_step_fn)
    last_tokens: jax.Array  # [max_slots] int32: each slot's latest sample, the next decode row's input
    # What the penalties read (jaxserve.model.sampler), kept current by every step from its input tokens: each
    # slot's output token counts and which tokens its prompt holds. A slot's are reset by the step that computes
    # its request's position 0; requests with penalties take no prefix-cache hits, so every token they hold passes
    # through a step (SamplingParams.reads_every_prompt_token).
    counts: jax.Array  # [max_slots, vocab] int32
    in_prompt: jax.Array  # [max_slots, vocab] bool

    @staticmethod
    def zeros(cache: Any, max_slots: int, vocab: int, put: Callable[[Any], Any] = lambda x: x) -> DeviceState:
        return DeviceState(cache, put(jnp.zeros(max_slots, jnp.int32)), put(jnp.zeros((max_slots, vocab), jnp.int32)),
                           put(jnp.zeros((max_slots, vocab), bool)))


# The fields of the packed step input in column order, and how many columns each takes (width w, pages p).
_PACKED = (("page_table", lambda w, p: p), ("positions", lambda w, p: w), ("tokens", lambda w, p: w),
           ("valid", lambda w, p: w), ("feed", None), ("slots", None), ("last", None), ("prompt_len", None))
# Each field starts at a multiple of 64 int32 columns (256 bytes). In a one-row bucket a field is a contiguous
# slice of the packed array, which XLA hands to a custom call as a pointer into it instead of copying; Mosaic GPU
# kernels refuse an operand that is not 256-byte aligned ("Input buffer 3 is not 256-byte aligned": the page
# table, when it sat 6 columns in).
_PACKED_ALIGN = 64


def _packed_columns(width: int, pages: int) -> dict[str, slice]:
    """Where each field of `pack_step_input` lies in a row of the packed array."""
    columns, at = {}, 0
    for name, size in _PACKED:
        n = size(width, pages) if size else 1
        columns[name] = slice(at, at + n)
        at = -(-(at + n) // _PACKED_ALIGN) * _PACKED_ALIGN
    return columns


def pack_step_input(inp: StepInput) -> np.ndarray:
    """The inputs `step_fn` reads, side by side in one int32 array [rows, columns], each field 256-byte aligned
    (`_PACKED_ALIGN`): one copy to the device for a greedy step instead of seven (a step that samples sends the
    sampler its own). On the H100 machine the seven numpy inputs cost ~2 ms of host time a dispatch
    (3.41 against 1.45 ms with inputs already on the device); `unpack_step_input`
    takes them apart on the device."""
    rows, width, pages = inp.shape
    columns = _packed_columns(width, pages)
    packed = np.zeros((rows, list(columns.values())[-1].stop), np.int32)
    for name, where in columns.items():
        x = getattr(inp, name)
        packed[:, where] = x if x.ndim == 2 else x[:, None]
    return packed


def unpack_step_input(packed: jax.Array, width: int, pages: int) -> dict[str, jax.Array]:
    """`pack_step_input` undone on the device: each field in its dtype (bool fields as bool, others int32)."""
    fields = {}
    for name, where in _packed_columns(width, pages).items():
        x = packed[:, where]
        if name in ("feed", "slots", "last", "prompt_len"):
            x = x[:, 0]
        fields[name] = x != 0 if name in ("valid", "feed") else x
    return fields


StepResult = tuple[jax.Array, jax.Array, jax.Array | None, DeviceState]


def step_fn(weights: Weights, state: DeviceState, inp: dict[str, jax.Array], *,
            cfg: ModelConfig, attention: str | AttentionFn = "auto") -> StepResult:
    """One forward over a bucket, taking each row's greedy token -> (packed [rows, 2 + 2 * NUM_TOP] with no top
    log-probabilities, logits [rows, vocab] float32, the last layer's output at every position [rows, width,
    embed] for prompt log-probabilities (None in a one-token bucket: its position never predicts a prompt token),
    state).

    Nothing here branches on a device value: XLA's GPU conditional copies its predicate to the host and
    blocks the host until the stream reaches it (ConditionalThunk), so a `lax.cond` would stall every step's
    launches behind its own forward pass. The host knows which steps sample or want top log-probabilities
    (it built their inputs) and runs `sample_fn` on the logits after those."""
    tokens_in = _tokens_in(state, inp)
    out = forward(weights, cfg, tokens_in, inp["positions"], inp["valid"], inp["page_table"],
                  state.cache, logit_indices=inp["last"], attention=attention)
    return _greedy_step(out.logits[:, 0], out.final, out.cache, state, inp, tokens_in)


def _tokens_in(state: DeviceState, inp: dict[str, jax.Array]) -> jax.Array:
    """The step's tokens, a fed row's first taken from its slot's last sample (jaxserve.engine's one-step-ahead)."""
    fed = state.last_tokens[jnp.minimum(inp["slots"], state.last_tokens.shape[0] - 1)]
    return inp["tokens"].at[:, 0].set(jnp.where(inp["feed"], fed, inp["tokens"][:, 0]))


def _greedy_step(logits: jax.Array, final: jax.Array | None, cache: Any, state: DeviceState,
                 inp: dict[str, jax.Array], tokens_in: jax.Array) -> StepResult:
    """A step's end from its logits [rows, vocab]: each row's greedy token, packed with no top log-probabilities,
    and the state with `cache`, the rows' tokens as their slots' last and the input tokens counted."""
    tokens, chosen = greedy(logits)
    none = (jnp.zeros((logits.shape[0], NUM_TOP), jnp.int32), jnp.zeros((logits.shape[0], NUM_TOP), jnp.float32))
    packed, last_tokens = commit(chosen, tokens, state.last_tokens, inp["slots"], none)
    counts, in_prompt = _count_inputs(state, inp, tokens_in)
    return packed, logits, final if tokens_in.shape[1] > 1 else None, DeviceState(cache, last_tokens, counts,
                                                                                   in_prompt)


def _count_inputs(state: DeviceState, inp: dict[str, jax.Array], tokens_in: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The slots' token counts and prompt tokens with this step's input tokens added: a token at a position before
    its request's prompt_len is a prompt token, any later one an output token. A row computing position 0 starts
    its slot afresh. Padding rows (slot max_slots) and padding positions write nothing."""
    max_slots = state.counts.shape[0]
    slots, valid, positions = inp["slots"], inp["valid"], inp["positions"]
    fresh = jnp.where(valid[:, 0] & (positions[:, 0] == 0), slots, max_slots)
    counts = state.counts.at[fresh].set(0, mode="drop")
    in_prompt = state.in_prompt.at[fresh].set(False, mode="drop")
    is_prompt = positions < inp["prompt_len"][:, None]
    rows = jnp.broadcast_to(slots[:, None], tokens_in.shape)
    in_prompt = in_prompt.at[jnp.where(valid & is_prompt, rows, max_slots), tokens_in].set(True, mode="drop")
    counts = counts.at[jnp.where(valid & ~is_prompt, rows, max_slots), tokens_in].add(1, mode="drop")
    return counts, in_prompt


def verify_step_fn(weights: Weights, state: DeviceState, inp: dict[str, jax.Array], *, cfg: ModelConfig,
                   attention: str | AttentionFn = "auto") -> tuple[jax.Array, DeviceState]:
    """A speculative verify step: each row's last token and drafts through the model, their K/V written (a
    rejected draft's is overwritten later: the engine rolls back by length) -> (logits at every position [rows,
    width, vocab] float32, state)."""
    tokens_in = inp["tokens"]
    out = forward(weights, cfg, tokens_in, inp["positions"], inp["valid"], inp["page_table"], state.cache,
                  attention=attention)
    counts, in_prompt = _count_inputs(state, inp, tokens_in)
    return out.logits, DeviceState(out.cache, state.last_tokens, counts, in_prompt)


def prompt_fn(weights: Weights, final: jax.Array, targets: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Prompt log-probabilities of a prefill step (sampler.prompt_logprobs) from its `final` [rows, width, embed]
    and targets [rows, width] -> [rows, width, 1 + 2 * NUM_TOP]; the logits are made a block of positions at a
    time, so a long chunk never holds [width, vocab] float32 at once."""
    rows, width, embed = final.shape
    block = math.gcd(rows * width, 256)
    blocks = (final.reshape(-1, block, embed), targets.reshape(-1, block))
    out = jax.lax.map(lambda b: prompt_logprobs(head_logits(weights, cfg, b[0]), b[1]), blocks)
    return out.reshape(rows, width, -1)


def stacked_step_fn(params: tuple[Weights, StackedLayers], state: DeviceState, inp: dict[str, jax.Array], *,
                    cfg: ModelConfig, attention: str, page_size: int) -> StepResult:
    """step_fn with the decode megakernel (EngineConfig.decode_megakernel): params are the weights and their layers
    stacked, and the cache is (k, v), every layer's pages stacked [layers · kv_heads · pages · page_size,
    head_dim] (decode_megakernel.stack_pages). A decode step (one row) runs every layer in one kernel
    (`decode_stacked`); a prefill step runs `forward` on each layer's pages, a view of the stacked pool, and stacks
    what it wrote back. A padding decode row attends over the pool's padding page (the last) and writes there."""
    weights, layers = params
    k_pages, v_pages = state.cache
    tokens_in = _tokens_in(state, inp)
    per_layer = (cfg.num_layers, cfg.num_kv_heads, -1, page_size, cfg.head_dim)
    if tokens_in.shape[1] == 1:
        padding = k_pages.reshape(per_layer).shape[2] - 1
        valid = inp["valid"][:, 0]
        table = jnp.where(valid[:, None], inp["page_table"], padding)
        lengths = jnp.where(valid, inp["positions"][:, 0], 1)  # (the kernel attends over at least one position)
        logits, k_pages, v_pages = decode_stacked(weights, layers, cfg, tokens_in, lengths, table, k_pages, v_pages,
                                                  page_size, backend=attention)
        final = None
    else:
        views = [tuple(pages.reshape(per_layer)) for pages in (k_pages, v_pages)]
        out = forward(weights, cfg, tokens_in, inp["positions"], inp["valid"], inp["page_table"],
                      KVCache(k=views[0], v=views[1], padding_page=True), logit_indices=inp["last"],
                      attention=attention)
        k_pages, v_pages = (jnp.stack(pages).reshape(k_pages.shape) for pages in (out.cache.k, out.cache.v))
        logits, final = out.logits[:, 0], out.final
    return _greedy_step(logits, final, (k_pages, v_pages), state, inp, tokens_in)
