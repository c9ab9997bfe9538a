"""The fixed set of decode slots. Host side: no jax here."""

from __future__ import annotations

import heapq


class SlotTable:
    """`max_slots` slots; a finished request frees its slot for the next step.

    The lowest free slot is handed out first, so busy slots stay packed at the front and a
    lightly loaded engine runs a small decode bucket.
    """

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._free = list(range(max_slots))
        self._busy: set[int] = set()

    def acquire(self) -> int | None:
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._busy.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self._busy, f"slot {slot} released but not in use"
        self._busy.remove(slot)
        heapq.heappush(self._free, slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
