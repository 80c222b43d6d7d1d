"""Event priorities of a simulated run and the shape of a handler's follow-up events.

At equal times events run by priority, lowest first: work finishes before it is
observed, and decisions come last, so a decision sees everything that happened at its
time. A follow-up is ``(time_s, event, priority)``; an event is a tuple whose first item
names its handler.
"""

from __future__ import annotations

from typing import Any

P_STEP, P_ARRIVE, P_SLURM, P_PLAN, P_TRAIN, P_DECIDE = range(6)

Follow = list[tuple[float, tuple[Any, ...], int]]
