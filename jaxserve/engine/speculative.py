"""Speculative decoding's host side: proposers, and the counters vLLM names. No jax here.

A speculating request is planned only once its last token is on the host (a verify row's tokens are its last
token and its drafts), so it leaves the one-step-ahead loop: it runs a step, waits for the step's tokens, and
proposes again. Requests that do not speculate keep the loop. The verification itself is in the step
(jaxserve.model.sampler.verify_fn); the scheduler rolls back what was not accepted (Scheduler.commit_verify).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config import SpeculativeConfig


def ngram_proposal(ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `ids`, for the longest n from max_n down to min_n that occurs; [] if none does."""
    seq = np.asarray(ids, np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)  # those ending before the last token
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters: verify rows (drafts), proposed tokens, accepted tokens, and accepted
    tokens by their position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class NgramProposer:
    """Proposes by prompt lookup over a request's prompt and output (SpeculativeConfig: method ngram)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        return ngram_proposal(ids, k, self.cfg.min_n, self.cfg.max_n)
