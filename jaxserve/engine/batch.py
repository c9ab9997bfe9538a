"""The two types that cross the host/device seam: StepInput and StepOutput. No jax here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.engine.scheduler import Chunk

NUM_TOP = 20  # top log-probabilities computed for every row; requests take the first `logprobs`


@dataclass
class StepInput:
    """Fixed-shape arrays for one step over `rows` rows of `width` tokens."""

    tokens: np.ndarray  # [rows, width] int32
    feed: np.ndarray  # [rows] bool: token 0 is the slot's last sample, still on the device
    slots: np.ndarray  # [rows] int32: the slot of each row (max_slots for padding)
    positions: np.ndarray  # [rows, width] int32
    valid: np.ndarray  # [rows, width] bool
    page_table: np.ndarray  # [rows, pages_per_slot] int32
    last: np.ndarray  # [rows] int32: index of the token whose logits are sampled
    seeds: np.ndarray  # [rows] uint32
    steps: np.ndarray  # [rows] int32: index of the token being sampled
    temperature: np.ndarray  # [rows] float32
    top_k: np.ndarray  # [rows] int32
    top_p: np.ndarray  # [rows] float32
    want_top: np.ndarray  # [rows] bool: the request asked for top log-probabilities

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, width, pages per row): the compiled bucket this input needs."""
        return (*self.tokens.shape, self.page_table.shape[1])  # type: ignore[return-value]

    @staticmethod
    def build(rows: list[Chunk | None], width: int, pages_per_slot: int, max_slots: int) -> StepInput:
        """Row i computes positions [start, start + length) of its request; None rows are padding.

        A position past the tokens the host knows holds the token the previous step sampled: the
        device takes it from its own copy of each slot's last sample (`feed`).
        """
        n = len(rows)
        inp = StepInput(
            tokens=np.zeros((n, width), np.int32), feed=np.zeros(n, bool), slots=np.full(n, max_slots, np.int32),
            positions=np.zeros((n, width), np.int32),
            valid=np.zeros((n, width), bool), page_table=np.zeros((n, pages_per_slot), np.int32),
            last=np.zeros(n, np.int32), seeds=np.zeros(n, np.uint32), steps=np.zeros(n, np.int32),
            temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
            want_top=np.zeros(n, bool),
        )
        for i, row in enumerate(rows):
            if row is None:
                continue
            request, start, length = row.request, row.start, row.length
            known = request.known_ids(start, start + length)
            inp.tokens[i, :len(known)] = known
            if len(known) < length:
                assert len(known) == length - 1 == 0, "only a decode row's one token can be still on the device"
                inp.feed[i] = True
            assert request.slot is not None
            inp.slots[i] = request.slot
            inp.positions[i, :length] = np.arange(start, start + length) if length > 1 else start
            inp.valid[i, :length] = True
            inp.page_table[i, :len(request.pages)] = request.pages
            inp.last[i] = length - 1
            p = request.params
            inp.seeds[i], inp.steps[i] = p.seed, max(0, len(request.output_ids) + request.unread - 1)
            inp.temperature[i], inp.top_k[i], inp.top_p[i] = p.temperature, p.top_k, p.top_p
            inp.want_top[i] = p.logprobs > 0
        return inp


@dataclass
class StepOutput:
    """Per row: the sampled token, its log-probability and the top NUM_TOP alternatives."""

    tokens: np.ndarray  # [rows] int32
    logprobs: np.ndarray  # [rows] float32
    top_ids: np.ndarray  # [rows, NUM_TOP] int32
    top_logprobs: np.ndarray  # [rows, NUM_TOP] float32

    @staticmethod
    def unpack(packed: np.ndarray) -> StepOutput:
        """Splits the one array the device returns ([rows, 2 + 2 * NUM_TOP] float32)."""
        return StepOutput(tokens=packed[:, 0].astype(np.int32), logprobs=packed[:, 1],
                          top_ids=packed[:, 2:2 + NUM_TOP].astype(np.int32), top_logprobs=packed[:, 2 + NUM_TOP:])
