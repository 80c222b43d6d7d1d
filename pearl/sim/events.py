"""The simulator's event loop: a heap of timed events, each returning its follow-ups.

As in Vidur, the loop pops the earliest event, moves the virtual clock to its time and
hands it to the handler, which returns the events it causes. Nothing reads a wall clock.

Ordering is total and deterministic: by time, then by the event's ``priority`` (lower
first: e.g. a request finishing before the decision that observes it), then by the order
in which events were scheduled (a counter owned by the loop, not a module global). So the
same inputs give the same run, bit for bit (``tests/sim/test_events.py``).

Invariants: the clock never moves backwards; an event scheduled in the past is an error;
``run`` stops before the first event later than ``until_s`` and leaves it queued.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

E = TypeVar("E")

# (time_s, priority, seq, event): plain tuples compare in C; ``seq`` is unique, so the
# event itself is never compared
_Scheduled = tuple[float, int, int, E]


class EventLoop(Generic[E]):
    """A virtual clock and the events still to happen."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s
        self._heap: list[_Scheduled[E]] = []
        self._next_seq = 0
        self.num_processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, time_s: float, event: E, priority: int = 0) -> None:
        if time_s < self.now_s:
            raise ValueError(f"event at {time_s} s scheduled in the past (now {self.now_s} s)")
        heapq.heappush(self._heap, (time_s, priority, self._next_seq, event))
        self._next_seq += 1

    def pending(self) -> list[tuple[float, E]]:
        """The events still to happen with their times, in no particular order."""
        return [(item[0], item[3]) for item in self._heap]

    def peek_time_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(
        self,
        handle: Callable[[E, float], Iterable[tuple[float, E, int]]],
        until_s: float = float("inf"),
    ) -> None:
        """Process events up to ``until_s``; ``handle(event, now_s)`` returns follow-ups
        as ``(time_s, event, priority)``."""
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            now_s, _, _, current = heapq.heappop(heap)
            self.now_s = now_s
            self.num_processed += 1
            for time_s, event, priority in handle(current, now_s):
                if time_s < now_s:
                    raise ValueError(f"event at {time_s} s scheduled in the past (now {now_s} s)")
                heapq.heappush(heap, (time_s, priority, self._next_seq, event))
                self._next_seq += 1
        if until_s != float("inf"):
            self.now_s = max(self.now_s, until_s)
