"""Slurm as the simulator sees it: elastic requests, queueing, grants and preemption.

External GPUs exist only inside availability windows (``pearl.sim.availability``), as
whole 8-GPU nodes. A request waits a queueing delay (lognormal, drawn per request) and
is then granted as soon as enough idle nodes of its GPU type are open, first come first
served. A granted allocation lives until the earliest end of its nodes' windows: the
owner reclaims the nodes then, and Slurm warns ``grace_s`` before (``preempting``, with
the deadline). A released allocation's nodes are idle again for later requests.

Pure: the caller owns the clock, the heap and the generator; methods return what
happened as ``SlurmEvent`` values with their times.

Invariants: a node belongs to at most one live allocation; an allocation never outlives
a window of its nodes; every request ends granted, pending (when the run ends) or
released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from pearl.sim.availability import GPUS_PER_NODE, Window


@dataclass(frozen=True)
class Node:
    name: str
    gpu_type: str
    opens_s: float
    closes_s: float


@dataclass
class Job:
    allocation_id: str
    gpu_type: str
    num_gpus: int
    submitted_s: float
    eligible_s: float
    nodes: tuple[Node, ...] = ()
    status: Literal["pending", "granted", "preempting", "ended"] = "pending"

    @property
    def ends_s(self) -> float:
        return min(n.closes_s for n in self.nodes)


@dataclass(frozen=True)
class SlurmEvent:
    time_s: float
    kind: Literal["granted", "preempting", "ended"]
    allocation_id: str


@dataclass
class SlurmModel:
    nodes: tuple[Node, ...]
    queue_delay_median_s: float
    queue_delay_sigma: float
    grace_s: float
    rng: np.random.Generator
    jobs: dict[str, Job] = field(default_factory=dict)
    _busy: set[str] = field(default_factory=set)

    @staticmethod
    def from_windows(windows: tuple[Window, ...], **kw: object) -> SlurmModel:
        nodes = tuple(
            Node(f"w{i:03d}n{k}", w.gpu_type, w.start_s, w.end_s)
            for i, w in enumerate(windows)
            for k in range(w.num_gpus // GPUS_PER_NODE)
        )
        return SlurmModel(nodes, **kw)  # type: ignore[arg-type]

    def submit(self, now_s: float, allocation_id: str, gpu_type: str, num_gpus: int) -> float:
        """Queue a request; the time it becomes eligible for a grant."""
        delay_s = float(
            self.queue_delay_median_s * math.exp(self.queue_delay_sigma * self.rng.normal())
        )
        job = Job(allocation_id, gpu_type, num_gpus, now_s, now_s + delay_s)
        self.jobs[allocation_id] = job
        return job.eligible_s

    def release(self, allocation_id: str) -> None:
        job = self.jobs.get(allocation_id)
        if job is None or job.status == "ended":
            return
        job.status = "ended"
        self._busy.difference_update(n.name for n in job.nodes)

    def schedule(self, now_s: float) -> list[SlurmEvent]:
        """Grant eligible pending jobs onto open idle nodes (FIFO); their future events."""
        out: list[SlurmEvent] = []
        for job in sorted(self.jobs.values(), key=lambda j: (j.submitted_s, j.allocation_id)):
            if job.status != "pending" or job.eligible_s > now_s:
                continue
            free = [
                n
                for n in self.nodes
                if n.gpu_type == job.gpu_type
                and n.name not in self._busy
                and n.opens_s <= now_s < n.closes_s
            ]
            need = -(-job.num_gpus // GPUS_PER_NODE)
            if len(free) < need:
                break  # first come first served: no overtaking
            free.sort(key=lambda n: (-n.closes_s, n.name))  # the longest-lived nodes first
            job.nodes = tuple(free[:need])
            job.status = "granted"
            self._busy.update(n.name for n in job.nodes)
            out.append(SlurmEvent(now_s, "granted", job.allocation_id))
            warn_s = max(now_s, job.ends_s - self.grace_s)
            out.append(SlurmEvent(warn_s, "preempting", job.allocation_id))
            out.append(SlurmEvent(job.ends_s, "ended", job.allocation_id))
        return out

    def wakeups(self) -> list[float]:
        """Times at which capacity opens: window starts (for pending jobs to retry)."""
        return sorted({n.opens_s for n in self.nodes})

    def apply(self, ev: SlurmEvent) -> bool:
        """Move a job to the event's status; False when the event is stale (released)."""
        job = self.jobs[ev.allocation_id]
        if job.status == "ended":
            return False
        if ev.kind == "preempting":
            job.status = "preempting"
        elif ev.kind == "ended":
            job.status = "ended"
            self._busy.difference_update(n.name for n in job.nodes)
        return True
