"""A request and its counters. Host side: no jax here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config import SamplingParams


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation. Its computed tokens (K/V in the cache) chase its total tokens.

    Prefill, chunked prefill and decode are the same thing seen from here: while
    `num_computed < num_tokens - 1` the next step computes a chunk of the prompt; at
    `num_computed == num_tokens - 1` it computes the last token and samples the next one.

    The engine plans step N+1 before it reads step N, so the host runs one step ahead of what
    it knows: `num_computed` counts positions whose K/V a dispatched step writes, `unread`
    the tokens sampled on the device but not read back yet (they are fed to the next step on
    the device), and `num_committed` the positions of steps already read.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # order of arrival; later arrivals are preempted first
    stop_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower is admitted first
    deadline: float | None = None  # time.monotonic() past which the caller no longer waits: never scheduled after it
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: an entry per prompt position, None at the first (nothing predicts it)
    # and until the prefill computes it
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)
    state: State = State.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    # of those, the first `released` went back to the pool, wholly behind every layer's window (Scheduler); their
    # entries stay, stale, in the page table, which no kernel reads there
    released: int = 0
    num_computed: int = 0
    num_committed: int = 0
    unread: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    preemptions: int = 0
    finish_reason: str | None = None
    text: str = ""
    submitted_at: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None  # when it first took a slot
    token_times: list[float] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)  # prefix hashes of its first full pages (tokens only grow)
    matcher: Any = None  # with SamplingParams.grammar: its llguidance matcher, fed each token read back

    @property
    def all_ids(self) -> list[int]:
        """The tokens the host knows: the prompt and the outputs read back so far."""
        return self.prompt_ids + self.output_ids

    def known_ids(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` without building the whole list (a decode row needs one token of it)."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.unread

    @property
    def pending(self) -> int:
        """Tokens whose K/V is not in the cache yet."""
        return self.num_tokens - self.num_computed

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED
