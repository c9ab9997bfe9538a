"""Multi-host lockstep: every process runs every step, and only the leader (process 0) plans them.

A step on a mesh that spans processes is one SPMD program: each process must launch the same
compiled step with the same input, or the collectives inside it never complete. The leader's engine
builds each StepInput; before launching it the leader broadcasts it with
`jax.experimental.multihost_utils.broadcast_one_to_all` (a psum over every process's devices: JAX's
own collective, no side channel to secure or configure), as two messages: a header
(command, rows, width, pages) and then the input's arrays packed into one int32 buffer, whose size
the header fixes. Followers wait in `receive`, launch the same step, and never read its results;
the leader's `close` sends STOP and they return. Each header costs one small collective per step;
the engine never blocks on it beyond the time the followers take to reach it (they wait there).
"""

from __future__ import annotations

import numpy as np

from jaxserve.engine.batch import StepInput

STEP, STOP = 1, 2


def pack(inp: StepInput) -> np.ndarray:
    """Every array of the input as int32 words, in field order (all are 4-byte or bool)."""
    parts = []
    for x in vars(inp).values():
        parts.append(x.astype(np.int32).ravel() if x.dtype == np.bool_ else np.ascontiguousarray(x).view(np.int32).ravel())
    return np.concatenate(parts)


def unpack(words: np.ndarray, shape: tuple[int, int, int], max_slots: int) -> StepInput:
    """The inverse of `pack` for an input of bucket `shape` (rows, width, pages)."""
    template = StepInput.build([None] * shape[0], shape[1], shape[2], max_slots)
    fields, at = {}, 0
    for name, x in vars(template).items():
        chunk = words[at:at + x.size].reshape(x.shape)
        fields[name] = chunk != 0 if x.dtype == np.bool_ else chunk.view(x.dtype).copy()
        at += x.size
    return StepInput(**fields)


class Lockstep:
    """The leader's `send` and `close`, the followers' `receive`: one StepInput at a time, in order."""

    def __init__(self, max_slots: int) -> None:
        import jax

        self.max_slots = max_slots
        self.is_leader = jax.process_index() == 0

    @staticmethod
    def _broadcast(words: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(words))

    def send(self, inp: StepInput) -> None:
        assert self.is_leader
        self._broadcast(np.array([STEP, *inp.shape], np.int32))
        self._broadcast(pack(inp))

    def close(self) -> None:
        """Lets the followers return from `receive` (None)."""
        if self.is_leader:
            self._broadcast(np.array([STOP, 0, 0, 0], np.int32))

    def receive(self) -> StepInput | None:
        """The next step's input from the leader, or None when it closed."""
        assert not self.is_leader
        command, *shape = (int(x) for x in self._broadcast(np.zeros(4, np.int32)))
        if command == STOP:
            return None
        bucket = (shape[0], shape[1], shape[2])
        size = pack(StepInput.build([None] * bucket[0], bucket[1], bucket[2], self.max_slots)).size
        return unpack(self._broadcast(np.zeros(size, np.int32)), bucket, self.max_slots)
