"""Elastic devices on one machine that come and go on the shipped availability schedule.

``ScheduledBackend`` wraps an allocation backend (``LocalBackend`` in ``pearl run``: one
submitit job holding each allocation): a request waits (pending) until a window of the
schedule is open, then goes to the wrapped backend, which grants it at once; when the
window closes the allocation is preempted (``AllocationPreempting``, the grace period
``grace_s``) and, at the grace's end, released there and ended here as ``preempted``. The
grant's end is the window's end (``end_by_s``), which decide()'s elastic rule weighs.

The schedule: the Helios idle windows pearl ships (``pearl/data/helios_windows.json``,
``pearl.io.data_files``), compressed ``time_scale`` times (1000: an hour of the trace is
3.6 s of the run), from the trace's first window on; one slot per window (a window's
``num_gpus`` are whole 8-GPU nodes of the trace; here its size is the request's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pearl.cluster.backend import AllocationBackend
from pearl.core.decision import ElasticRequest
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    Event,
    WorkersLost,
)
from pearl.core.state import EndReason
from pearl.io.data_files import read_windows, shipped

Span = tuple[float, float]  # (start_s, end_s) in run seconds


def compressed_windows(
    time_scale: float, min_duration_s: float = 0.0, name: str = "helios_windows.json"
) -> tuple[Span, ...]:
    """The shipped windows, ``time_scale`` times faster, from the first one's start on (a
    window shorter than ``min_duration_s`` of the run is left out)."""
    rows = read_windows(shipped(name), gpu_type="cpu", min_duration_s=0.0)
    t0 = rows[0].start_s
    spans = (((w.start_s - t0) / time_scale, (w.end_s - t0) / time_scale) for w in rows)
    return tuple((a, b) for a, b in spans if b - a >= min_duration_s)


@dataclass
class ScheduledBackend:
    """``AllocationBackend`` whose grants follow ``windows`` (the module docstring)."""

    inner: AllocationBackend
    windows: tuple[Span, ...]
    grace_s: float = 2.0
    offset_s: float = 0.0  # run time of the schedule's 0
    _waiting: dict[str, ElasticRequest] = field(default_factory=dict)
    _granted: dict[str, float] = field(default_factory=dict)  # allocation -> window end
    _preempting: dict[str, float] = field(default_factory=dict)  # allocation -> deadline
    _ended: set[str] = field(default_factory=set)

    def window_at(self, now_s: float) -> Span | None:
        t = now_s - self.offset_s
        return next(((a, b) for a, b in self.windows if a <= t < b), None)

    def submit(self, request: ElasticRequest, allocation_id: str) -> None:
        self._waiting[allocation_id] = request

    def poll(self, now_s: float) -> list[Event]:
        events: list[Event] = []
        window = self.window_at(now_s)
        for aid, request in list(self._waiting.items()):
            if window is None:
                events.append(
                    AllocationPending(
                        allocation_id=aid, gpu_type=request.gpu_type, num_gpus=request.num_gpus
                    )
                )
                continue
            del self._waiting[aid]
            self.inner.submit(request, aid)
            self._granted[aid] = window[1] + self.offset_s
        for ev in self.inner.poll(now_s):
            if isinstance(ev, WorkersLost):
                events.append(ev)
                continue
            aid = ev.allocation_id
            if aid in self._ended:
                continue  # ended here already (preempted)
            if isinstance(ev, AllocationGranted) and aid in self._granted:
                ev = ev.model_copy(update={"end_by_s": self._granted[aid]})
            events.append(ev)
            if isinstance(ev, AllocationEnded):
                self._forget(aid)
        for aid, end_s in list(self._granted.items()):
            if aid not in self._preempting and now_s >= end_s:
                self._preempting[aid] = now_s + self.grace_s
                events.append(
                    AllocationPreempting(allocation_id=aid, deadline_s=now_s + self.grace_s)
                )
        for aid, deadline_s in list(self._preempting.items()):
            if now_s >= deadline_s:
                self.inner.release(aid)
                self._forget(aid)
                self._ended.add(aid)
                events.append(AllocationEnded(allocation_id=aid, reason=EndReason.PREEMPTED))
        return events

    def _forget(self, aid: str) -> None:
        self._granted.pop(aid, None)
        self._preempting.pop(aid, None)

    def reattach(self, request: ElasticRequest, allocation_id: str) -> bool:
        return self.inner.reattach(request, allocation_id)

    def release(self, allocation_id: str) -> None:
        if self._waiting.pop(allocation_id, None) is not None:
            return
        self._forget(allocation_id)
        self.inner.release(allocation_id)

    def job_id(self, allocation_id: str) -> str:
        return self.inner.job_id(allocation_id)

    def close(self) -> None:
        self.inner.close()
