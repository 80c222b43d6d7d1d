"""The simulator's side of elastic allocations, between the Slurm model and the run.

Slurm's events become observations for the next decision (``take_events``), the GPUs of
granted allocations are counted in GPU-time, and the engines on a reclaimed or released
allocation's nodes are taken off through the ``take_off_nodes`` callback, so that their
requests continue elsewhere. A request's grant is retried whenever capacity may have
appeared (its queueing delay over, a window opening, another allocation ending).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    Event,
    GrantedNode,
)
from pearl.core.state import EndReason
from pearl.runlog.schema import AllocationChanged, Record
from pearl.sim.availability import GPUS_PER_NODE
from pearl.sim.metrics import GpuClock
from pearl.sim.slurm import Job, SlurmModel
from pearl.sim.timeline import Decide, Eligible, Follow, SlurmChange

TakeOff = Callable[[set[str], float], Follow]
Status = Literal["requested", "granted", "preempting", "ended", "released"]


class ElasticAllocations:
    def __init__(
        self, slurm: SlurmModel, take_off_nodes: TakeOff, log: Callable[[Record], None]
    ) -> None:
        self.slurm, self.take_off_nodes, self.log = slurm, take_off_nodes, log
        self.clock = GpuClock()  # elastic GPUs held
        self.dead_nodes: set[str] = set()  # nodes reclaimed or released, not granted since
        self._events: list[Event] = []

    def take_events(self) -> tuple[Event, ...]:
        """What happened since the last decision, for its observation."""
        events, self._events = tuple(self._events), []
        return events

    def retry_times(self, duration_s: float) -> list[float]:
        return [t for t in self.slurm.wakeups() if t < duration_s]

    def on_eligible(self, now_s: float) -> Follow:
        return [(ev.time_s, SlurmChange(ev)) for ev in self.slurm.schedule(now_s)]

    def request(self, aid: str, gpu_type: str, num_gpus: int, now_s: float) -> Follow:
        eligible_s = self.slurm.submit(now_s, aid, gpu_type, num_gpus)
        self._events.append(
            AllocationPending(allocation_id=aid, gpu_type=gpu_type, num_gpus=num_gpus)
        )
        self._log(now_s, aid, "requested", gpu_type, num_gpus)
        return [(eligible_s, Eligible())]

    def on_slurm(self, change: SlurmChange, now_s: float) -> Follow:
        ev = change.change
        if not self.slurm.apply(ev):
            return []  # released before its time came
        job = self.slurm.jobs[ev.allocation_id]
        out: Follow = []
        if ev.kind == "granted":
            nodes = tuple(
                GrantedNode(node=n.name, gpu_type=n.gpu_type, num_gpus=GPUS_PER_NODE)
                for n in job.nodes
            )
            self._events.append(
                AllocationGranted(allocation_id=job.allocation_id, nodes=nodes, end_by_s=None)
            )
            self.dead_nodes -= {n.name for n in job.nodes}  # a node may be granted again
            self.clock.add(now_s, _gpus(job))
        elif ev.kind == "preempting":
            self._events.append(
                AllocationPreempting(allocation_id=job.allocation_id, deadline_s=job.ends_s)
            )
        else:
            self._events.append(
                AllocationEnded(allocation_id=job.allocation_id, reason=EndReason.PREEMPTED)
            )
            self.clock.add(now_s, -_gpus(job))
            out += self._kill(job, now_s)
            out += self.on_eligible(now_s)
        reason = EndReason.PREEMPTED if ev.kind == "ended" else ""
        self._log(now_s, job.allocation_id, ev.kind, job.gpu_type, job.num_gpus, reason)
        out.append((now_s, Decide(f"allocation {ev.kind}")))
        return out

    def release(self, allocation_id: str, now_s: float) -> Follow:
        job = self.slurm.jobs.get(allocation_id)
        if job is None or job.status == "ended":
            return []
        if job.status in ("granted", "preempting"):
            self.clock.add(now_s, -_gpus(job))
        out = self._kill(job, now_s)
        self.slurm.release(allocation_id)
        self._events.append(AllocationEnded(allocation_id=allocation_id, reason=EndReason.RELEASED))
        self._log(now_s, allocation_id, "released", job.gpu_type, job.num_gpus, EndReason.RELEASED)
        return out + self.on_eligible(now_s)

    def _kill(self, job: Job, now_s: float) -> Follow:
        nodes = {n.name for n in job.nodes}
        self.dead_nodes |= nodes
        return self.take_off_nodes(nodes, now_s)

    def _log(
        self, now_s: float, aid: str, status: Status, gpu_type: str, num_gpus: int, reason: str = ""
    ) -> None:
        self.log(
            AllocationChanged.model_construct(
                t=now_s,
                allocation_id=aid,
                status=status,
                gpu_type=gpu_type,
                num_gpus=num_gpus,
                reason=reason,
            )
        )


def _gpus(job: Job) -> int:
    """GPUs held: Slurm grants whole nodes."""
    return len(job.nodes) * GPUS_PER_NODE
