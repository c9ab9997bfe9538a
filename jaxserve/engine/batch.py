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
    def build(rows: list[Chunk | None], width: int, pages_per_slot: int, max_slots: int,
              page_tables: np.ndarray | None = None) -> StepInput:
        """Row i computes positions [start, start + length) of its request; None rows are padding.

        `page_tables` [max_slots, >= pages_per_slot] holds each slot's pages (the scheduler's
        `page_tables`); it is needed as soon as one row is not padding. A position past the tokens
        the host knows holds the token the previous step sampled: the device takes it from its own
        copy of each slot's last sample (`feed`).
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
        at = [i for i, row in enumerate(rows) if row is not None]
        if not at:
            return inp
        assert page_tables is not None, "rows that are not padding need the slots' page tables"
        chunks: list[Chunk] = [rows[i] for i in at]  # type: ignore[misc]
        requests = [c.request for c in chunks]
        for i, chunk in zip(at, chunks):  # the token ids: only a prefill row has more than one
            known = chunk.request.token_ids(chunk.start, chunk.start + chunk.length)
            if len(known) < chunk.length:
                assert len(known) == chunk.length - 1 == 0, "only a decode row's one token can be still on the device"
                inp.feed[i] = True
            else:
                inp.tokens[i, :len(known)] = known
        slots = np.array([r.slot for r in requests], np.int32)
        starts = np.array([c.start for c in chunks], np.int32)
        lengths = np.array([c.length for c in chunks], np.int32)
        offsets = np.arange(width, dtype=np.int32)
        valid = offsets < lengths[:, None]
        inp.slots[at] = slots
        inp.valid[at] = valid
        inp.positions[at] = np.where(valid, starts[:, None] + offsets, 0)
        inp.page_table[at] = page_tables[slots, :pages_per_slot]
        inp.last[at] = lengths - 1
        params = [r.params for r in requests]
        inp.seeds[at] = [p.seed for p in params]
        inp.steps[at] = [max(0, len(r.output_ids) + r.unread - 1) for r in requests]
        inp.temperature[at] = [p.temperature for p in params]
        inp.top_k[at] = [p.top_k for p in params]
        inp.top_p[at] = [p.top_p for p in params]
        inp.want_top[at] = [p.logprobs > 0 for p in params]
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
