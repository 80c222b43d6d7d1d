"""Every GPU's role over time, from ``gpu_added``, ``gpu_removed``, ``worker_phase`` and
``borrow`` records (one streaming pass).

A GPU is present from its ``gpu_added`` to its ``gpu_removed`` (or the run's end); its
role is that of the last ``worker_phase`` naming it (``idle`` before the first and after
a worker's ``gone``), in that record's phase; a ``worker_phase`` for a GPU never added
makes it present from then on, of source ``unknown``. A GPU may host several workers
(an offloaded engine beside the trainer): it shows the most active of them (a working
role before ``idle``, ``ready`` before other phases, the latest among equals); a
worker leaves its GPUs on ``gone`` or when a later record names other GPUs. Between a
``lend`` and the ``returned`` that follows it the lent GPUs are marked borrowed. A GPU
removed because its owner took it back (``decisions.is_preemption``) is marked preempted.

GPU-hours by role add up each segment; utilisation is the share of present GPU-time in a
working role (``train``, ``colocated``, ``prefill``, ``decode``) in phase ``ready``.

A log without any of these records (logs of simulators older than ``pearl.runlog.records``)
gives no segments; the report then draws borrow windows and elastic allocations instead,
and the figures that need GPUs (base hours, hours by role, utilisation) are ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pearl.analysis.decisions import is_preemption
from pearl.runlog.schema import BorrowChanged, GpuAdded, GpuRemoved, WorkerPhase

Handlers = dict[str, Callable[[Any], None]]
WORKING_ROLES = ("train", "colocated", "prefill", "decode")
ROLES = (*WORKING_ROLES, "idle")


@dataclass(frozen=True)
class Segment:
    gpu_id: str
    start_t: float
    end_t: float
    role: str
    phase: str
    source: str
    borrowed: bool

    @property
    def hours(self) -> float:
        return (self.end_t - self.start_t) / 3600.0


@dataclass(frozen=True)
class Marker:
    gpu_id: str
    t: float
    kind: str  # "added", "preempted", "removed", "lent", "returned"


@dataclass
class _Gpu:
    source: str
    since_t: float
    role: str = "idle"
    phase: str = "ready"
    borrowed: bool = False
    workers: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (role, phase)

    def effective(self) -> tuple[str, str]:
        """The role shown for the GPU: its workers' most active (a working role, then
        ready), the latest among equals; ``idle`` without workers."""
        best, rank = ("idle", "ready"), (-1, -1)
        for role, phase in self.workers.values():
            r = (role in WORKING_ROLES, phase == "ready")
            if (int(r[0]), int(r[1])) >= rank:
                best, rank = (role, phase), (int(r[0]), int(r[1]))
        return best


@dataclass
class GpuTimeline:
    segments: list[Segment] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    gpu_records: int = 0
    _gpus: dict[str, _Gpu] = field(default_factory=dict)
    _worker_gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _lent: set[str] = field(default_factory=set)

    def handlers(self) -> Handlers:
        return {
            "gpu_added": self._on_added,
            "gpu_removed": self._on_removed,
            "worker_phase": self._on_phase,
            "borrow": self._on_borrow,
        }

    @property
    def exact(self) -> bool:
        """Whether the log had GPU records to build the timeline from."""
        return self.gpu_records > 0

    def _cut(self, gpu_id: str, g: _Gpu, t: float) -> None:
        if t > g.since_t:
            self.segments.append(
                Segment(gpu_id, g.since_t, t, g.role, g.phase, g.source, g.borrowed)
            )
        g.since_t = max(g.since_t, t)

    def _on_added(self, r: GpuAdded) -> None:
        self.gpu_records += 1
        old = self._gpus.get(r.gpu_id)
        if old is not None and old.source == r.source:
            return  # repeated (a writer restarted after logging it): nothing new
        if old is not None:
            self._cut(r.gpu_id, old, r.t)
        self._gpus[r.gpu_id] = _Gpu(r.source, r.t, borrowed=r.gpu_id in self._lent)
        self.markers.append(Marker(r.gpu_id, r.t, "added"))

    def _on_removed(self, r: GpuRemoved) -> None:
        self.gpu_records += 1
        g = self._gpus.pop(r.gpu_id, None)
        if g is not None:
            self._cut(r.gpu_id, g, r.t)
        kind = "preempted" if is_preemption(r.reason) else "removed"
        self.markers.append(Marker(r.gpu_id, r.t, kind))

    def _on_phase(self, r: WorkerPhase) -> None:
        self.gpu_records += 1
        gone = r.phase == "gone"
        before = self._worker_gpus.pop(r.worker_id, ())
        if not gone:
            self._worker_gpus[r.worker_id] = r.gpu_ids
        for gpu_id in dict.fromkeys((*before, *r.gpu_ids)):
            g = self._gpus.get(gpu_id)
            if g is None:
                if gone or gpu_id not in r.gpu_ids:
                    continue
                g = self._gpus[gpu_id] = _Gpu("unknown", r.t, borrowed=gpu_id in self._lent)
            g.workers.pop(r.worker_id, None)
            if not gone and gpu_id in r.gpu_ids:
                g.workers[r.worker_id] = (r.role, r.phase)  # re-inserted: the latest
            role, phase = g.effective()
            if (role, phase) != (g.role, g.phase):
                self._cut(gpu_id, g, r.t)
                g.role, g.phase = role, phase

    def _on_borrow(self, r: BorrowChanged) -> None:
        if r.kind not in ("lend", "returned"):
            return
        lend = r.kind == "lend"
        for gpu_id in r.gpu_ids:
            if lend:
                self._lent.add(gpu_id)
            else:
                self._lent.discard(gpu_id)
            g = self._gpus.get(gpu_id)
            if g is not None and g.borrowed != lend:
                self._cut(gpu_id, g, r.t)
                g.borrowed = lend
            if self.exact:
                self.markers.append(Marker(gpu_id, r.t, r.kind))

    def all_segments(self, end_t: float) -> list[Segment]:
        """The closed segments plus every present GPU's open one, cut at ``end_t``."""
        open_ = [
            Segment(gid, g.since_t, end_t, g.role, g.phase, g.source, g.borrowed)
            for gid, g in self._gpus.items()
            if end_t > g.since_t
        ]
        return self.segments + open_

    def gpu_hours(self, end_t: float) -> dict[str, Any]:
        """Hours by role and by source, and utilisation; ``None`` where unknown."""
        if not self.exact:
            return {
                "by_role": None,
                "by_source": {"base": None, "borrowed": None, "elastic": None},
                "present_gpu_hours": None,
                "working_gpu_hours": None,
                "utilisation": None,
            }
        by_role = dict.fromkeys(ROLES, 0.0)
        base = elastic = present = working = 0.0
        for s in self.all_segments(end_t):
            h = s.hours
            present += h
            by_role[s.role] = by_role.get(s.role, 0.0) + h
            if s.role in WORKING_ROLES and s.phase == "ready":
                working += h
            if s.source.startswith("base"):
                base += h
            elif s.source == "elastic":
                elastic += h
        return {
            "by_role": {k: round(v, 6) for k, v in by_role.items()},
            "by_source": {"base": round(base, 6), "borrowed": None, "elastic": round(elastic, 6)},
            "present_gpu_hours": round(present, 6),
            "working_gpu_hours": round(working, 6),
            "utilisation": round(working / present, 6) if present else None,
        }

    def elastic_used_gpu_hours(self, end_t: float) -> float | None:
        """Elastic GPU-time in a working role (any phase); ``None`` without GPU records."""
        if not self.exact:
            return None
        return sum(
            s.hours
            for s in self.all_segments(end_t)
            if s.source == "elastic" and s.role in WORKING_ROLES
        )

    def notes(self) -> list[str]:
        if self.exact:
            return []
        return [
            "no gpu_added/gpu_removed/worker_phase records: the GPU timeline shows borrow "
            "windows and elastic allocations only; base GPU-hours, hours by role and "
            "utilisation are unknown"
        ]
