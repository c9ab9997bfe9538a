"""The two types that cross the host/device seam: StepInput and StepOutput. No jax here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.engine.scheduler import Chunk

NUM_TOP = 20  # top log-probabilities computed for every row; requests take the first `logprobs`
MAX_LOGIT_BIAS = 300  # logit_bias entries a request may send (vLLM's and OpenAI's limit)
MAX_SUPPRESSED = 64  # stop tokens min_tokens may hold back (end of sequence and stop_token_ids)
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_SUPPRESSED


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
    min_p: np.ndarray  # [rows] float32
    presence: np.ndarray  # [rows] float32: presence penalty
    frequency: np.ndarray  # [rows] float32: frequency penalty
    repetition: np.ndarray  # [rows] float32: repetition penalty
    bias_ids: np.ndarray  # [rows, BIAS_WIDTH] int32: logit_bias ids, then the stop tokens min_tokens holds back;
    # unused entries hold an id past the vocabulary (dropped)
    bias: np.ndarray  # [rows, BIAS_WIDTH] float32: what each entry adds (-inf for a held-back stop token)
    prompt_len: np.ndarray  # [rows] int32: the request's prompt tokens (later positions hold its output)
    targets: np.ndarray  # [rows, width] int32: for prompt log-probabilities, the prompt token after each position;
    # -1 where none is wanted

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
            want_top=np.zeros(n, bool), min_p=np.zeros(n, np.float32), presence=np.zeros(n, np.float32),
            frequency=np.zeros(n, np.float32), repetition=np.ones(n, np.float32),
            bias_ids=np.full((n, BIAS_WIDTH), np.iinfo(np.int32).max, np.int32),
            bias=np.zeros((n, BIAS_WIDTH), np.float32), prompt_len=np.zeros(n, np.int32),
            targets=np.full((n, width), -1, np.int32),
        )
        for i, row in enumerate(rows):
            if row is None:
                continue
            request, start, length = row.request, row.start, row.length
            known = request.known_ids(start, start + length) + row.drafts
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
            inp.min_p[i], inp.presence[i] = p.min_p, p.presence_penalty
            inp.frequency[i], inp.repetition[i] = p.frequency_penalty, p.repetition_penalty
            prompt = len(request.prompt_ids)
            inp.prompt_len[i] = prompt
            entries = list(p.logit_bias)
            if inp.steps[i] < p.min_tokens:
                entries += [(t, -np.inf) for t in sorted(request.stop_ids)]
            if entries:
                inp.bias_ids[i, :len(entries)], inp.bias[i, :len(entries)] = zip(*entries, strict=True)
            if p.prompt_logprobs is not None and start + 1 < prompt:
                after = request.prompt_ids[start + 1:min(start + length + 1, prompt)]
                inp.targets[i, :len(after)] = after
        return inp

    def greedy(self) -> StepInput:
        """These rows with every sampling parameter off: each takes its most likely token (a draft model's
        proposals)."""
        self.temperature[:], self.want_top[:], self.min_p[:], self.bias[:] = 0, False, 0, 0
        self.presence[:], self.frequency[:], self.repetition[:] = 0, 0, 1
        return self

    @property
    def samples(self) -> bool:
        """Whether a row needs the sampler after the step's greedy pass (jaxserve.step)."""
        return bool(self.temperature.any() or self.want_top.any() or self.min_p.any() or self.presence.any()
                    or self.frequency.any() or (self.repetition != 1).any() or self.bias.any())

    @property
    def sorts(self) -> bool:
        """Whether a sampling row needs the vocabulary sorted (top-k or top-p)."""
        drawn = self.temperature > 0
        return bool(((self.top_k > 0) | (self.top_p < 1))[drawn].any())


@dataclass
class StepOutput:
    """Per row: the sampled token, its log-probability and the top NUM_TOP alternatives."""

    tokens: np.ndarray  # [rows] int32
    logprobs: np.ndarray  # [rows] float32
    top_ids: np.ndarray  # [rows, NUM_TOP] int32
    top_logprobs: np.ndarray  # [rows, NUM_TOP] float32
    # [rows, width, 1 + 2 * NUM_TOP] float32 when a row asked for prompt log-probabilities: at each position, the
    # next prompt token's log-probability, then the top ids and log-probabilities (jaxserve.model.sampler)
    prompt: np.ndarray | None = None
    # A verify step's (speculative decoding): tokens emitted per row, accepted drafts + 1; the other fields then have
    # a position axis: tokens [rows, width], logprobs [rows, width], top_* [rows, width, NUM_TOP]
    counts: np.ndarray | None = None

    @staticmethod
    def unpack(packed: np.ndarray, prompt: np.ndarray | None = None) -> StepOutput:
        """Splits the one array the device returns ([rows, 2 + 2 * NUM_TOP] float32)."""
        return StepOutput(tokens=packed[..., 0].astype(np.int32), logprobs=packed[..., 1],
                          top_ids=packed[..., 2:2 + NUM_TOP].astype(np.int32), top_logprobs=packed[..., 2 + NUM_TOP:],
                          prompt=prompt)

    @staticmethod
    def unpack_verify(packed: np.ndarray, counts: np.ndarray) -> StepOutput:
        """A verify step's result ([rows, width, 2 + 2 * NUM_TOP] and the emitted counts [rows])."""
        out = StepOutput.unpack(packed)
        out.counts = counts
        return out
