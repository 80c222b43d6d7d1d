"""Allocation backends: the interface, and the pure state machine behind every backend.

A backend submits elastic allocations (one job each), watches them and releases them.
``poll(now_s)`` returns the observation events (``pearl.core.observation``) that happened
since the last poll, in order, for ``decide()``. Each backend turns what it can see of its
jobs into ``JobSnapshot`` values (pure data) and hands them to ``AllocationTracker``, which
turns successive snapshots into events. The tracker does no I/O and reads no clock.

Tracker invariants (tests assert them):
- per allocation, events come in this order, each at most once: ``AllocationPending``
  (queued at ``add``, so the core records the submit time even when the job starts before
  the next poll), ``AllocationGranted`` (first snapshot with nodes in a running state),
  ``AllocationPreempting`` (first snapshot with a preemption deadline, only after the
  grant), ``AllocationEnded`` (first snapshot in a terminal state); nothing after the end;
- feeding the same snapshots again yields no event (repeated polls are idempotent);
- snapshots of unknown allocations and unknown states are ignored.

End reasons (``AllocationEnded.reason``): ``preempted``, ``timeout``, ``node_fail`` when
Slurm says so; ``preempted`` also when a preemption was announced before the job ended in
any other way (a payload that exits on the warning signal ends FAILED or COMPLETED);
``released`` when this backend released it; ``cancelled`` (someone else), ``completed``,
``failed`` (non-zero exit, out of memory, boot failure, deadline, ...).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol, runtime_checkable

from pearl.core.decision import ElasticRequest
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    Event,
    GrantedNode,
)
from pearl.core.state import EndReason

# Slurm job states (``squeue %T``, ``sacct State``); backends without Slurm use the same.
PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESIZING"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "SUSPENDED"})
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "PREEMPTED",
        "TIMEOUT",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
_REASON_OF_STATE = {
    "PREEMPTED": EndReason.PREEMPTED,
    "TIMEOUT": EndReason.TIMEOUT,
    "DEADLINE": EndReason.TIMEOUT,
    "NODE_FAIL": EndReason.NODE_FAIL,
    "BOOT_FAIL": EndReason.NODE_FAIL,
    "CANCELLED": EndReason.CANCELLED,
    "COMPLETED": EndReason.COMPLETED,
}


class AllocationConfigError(ValueError):
    """The scheduler refused a request because of a config value; names the field.

    The CLI maps it to exit status 2. ``str()`` reads e.g.
    ``policy.elastic.partition: Slurm refused partition 'nope': <sbatch message>``.
    """

    def __init__(self, field_name: str, value: object, detail: str) -> None:
        self.field_name = field_name
        self.value = value
        self.detail = detail
        super().__init__(f"{field_name}: {detail}")


@runtime_checkable
class AllocationBackend(Protocol):
    """Where elastic allocations come from (Slurm, or this machine)."""

    def submit(self, request: ElasticRequest, allocation_id: str) -> None:
        """Ask for one allocation; raises ``AllocationConfigError`` if the config is refused."""
        ...

    def poll(self, now_s: float) -> list[Event]:
        """Events since the last poll, in order; ``now_s`` is the run clock. Never blocks long."""
        ...

    def reattach(self, request: ElasticRequest, allocation_id: str) -> bool:
        """Watch the job an earlier coordinator submitted for ``allocation_id``; False
        when there is none to find."""
        ...

    def release(self, allocation_id: str) -> None:
        """Give the allocation back; its ``AllocationEnded(reason='released')`` follows."""
        ...

    def job_id(self, allocation_id: str) -> str:
        """The scheduler's id of the allocation's job; ``KeyError`` if it has none."""
        ...

    def close(self) -> None:
        """Release every allocation not yet ended and stop watching."""
        ...


@dataclass(frozen=True)
class JobSnapshot:
    """What a backend saw of one allocation's job at one poll. Times on the run clock."""

    allocation_id: str
    state: str  # a Slurm job state name, e.g. PENDING, RUNNING, PREEMPTED
    nodes: tuple[str, ...] = ()
    end_by_s: float | None = None  # the time limit, while running
    preempt_deadline_s: float | None = None  # end of the grace period, once announced
    pending_reason: str | None = None  # Slurm's, e.g. Resources, Priority
    start_estimate_s: float | None = None  # Slurm's estimate, while pending


@dataclass
class _Tracked:
    request: ElasticRequest
    gpus_per_node: int
    granted: bool = False
    preempting: bool = False
    ended: bool = False
    released: bool = False
    last: JobSnapshot | None = None


def end_reason(state: str, *, released: bool, preempting: bool) -> EndReason:
    """``AllocationEnded.reason`` of a job that ended in ``state`` (see the module doc)."""
    by_slurm = _REASON_OF_STATE.get(state)
    if by_slurm in (EndReason.PREEMPTED, EndReason.TIMEOUT, EndReason.NODE_FAIL):
        return by_slurm
    if preempting:
        return EndReason.PREEMPTED
    if released:
        return EndReason.RELEASED
    return by_slurm or EndReason.FAILED


@dataclass
class AllocationTracker:
    """Successive snapshots in, observation events out (see the module doc)."""

    _allocations: dict[str, _Tracked] = field(default_factory=dict)
    _queued: list[Event] = field(default_factory=list)

    def add(self, allocation_id: str, request: ElasticRequest, gpus_per_node: int) -> None:
        if allocation_id in self._allocations:
            raise ValueError(f"allocation {allocation_id!r} was already submitted")
        self._allocations[allocation_id] = _Tracked(request, gpus_per_node)
        self._queued.append(
            AllocationPending(
                allocation_id=allocation_id,
                gpu_type=request.gpu_type,
                num_gpus=request.num_gpus,
            )
        )

    def mark_released(self, allocation_id: str) -> None:
        self._allocations[allocation_id].released = True

    def active(self) -> list[str]:
        """Allocations not yet ended, in submission order."""
        return [a for a, t in self._allocations.items() if not t.ended]

    def is_released(self, allocation_id: str) -> bool:
        return self._allocations[allocation_id].released

    def last_snapshot(self, allocation_id: str) -> JobSnapshot | None:
        return self._allocations[allocation_id].last

    def update(self, snapshots: Iterable[JobSnapshot]) -> list[Event]:
        """Events for the new snapshots, after any queued since the last update."""
        events, self._queued = self._queued, []
        for snap in snapshots:
            tracked = self._allocations.get(snap.allocation_id)
            if tracked is None or tracked.ended:
                continue
            tracked.last = snap
            events += _step(snap, tracked)
        return events


def _step(snap: JobSnapshot, t: _Tracked) -> list[Event]:
    events: list[Event] = []
    aid = snap.allocation_id
    if snap.state in RUNNING_STATES and snap.nodes and not t.granted:
        t.granted = True
        per_node = min(t.gpus_per_node, t.request.num_gpus)
        gpu_type = t.request.gpu_type
        nodes = tuple(GrantedNode(node=n, gpu_type=gpu_type, num_gpus=per_node) for n in snap.nodes)
        end_by = None if snap.end_by_s is None else max(0.0, snap.end_by_s)
        events.append(AllocationGranted(allocation_id=aid, nodes=nodes, end_by_s=end_by))
    deadline = snap.preempt_deadline_s
    if deadline is not None and t.granted and not t.preempting and not t.released:
        t.preempting = True
        events.append(AllocationPreempting(allocation_id=aid, deadline_s=max(0.0, deadline)))
    if snap.state in TERMINAL_STATES:
        t.ended = True
        reason = end_reason(snap.state, released=t.released, preempting=t.preempting)
        events.append(AllocationEnded(allocation_id=aid, reason=reason))
    return events


# ------------------------------------------------------------------ payload (job side) ---


@dataclass(frozen=True)
class HoldAllocation:
    """The job payload of a coordinator without agents: keeps the allocation alive.

    With agents configured, each allocation runs ``AgentPayload`` (``agent_payload.py``);
    without them (a coordinator that only takes and watches allocations, as the Slurm
    requeue test runs one) this holds the nodes until the allocation ends.

    Runs on each node of the allocation (submitit starts one task per node). It replaces
    submitit's USR2 handler, which would ``scontrol requeue`` the job on preemption: on the
    warning signal (preemption or time limit) it only notes the time on stdout and holds on,
    so the allocation lives to the end of the grace period; on SIGTERM or SIGINT (release,
    end of grace, time limit) it returns. ``max_hold_s`` bounds the hold (None: no bound).
    """

    max_hold_s: float | None = None
    tick_s: float = 0.2

    def __call__(self) -> str:
        stop: list[str] = []

        def note(signum: int, frame: FrameType | None) -> None:
            print(f"pearl-hold: {signal.Signals(signum).name} at {time.time():.3f}", flush=True)

        def finish(signum: int, frame: FrameType | None) -> None:
            note(signum, frame)
            stop.append(signal.Signals(signum).name)

        signal.signal(signal.SIGUSR2, note)
        signal.signal(signal.SIGUSR1, note)
        signal.signal(signal.SIGTERM, finish)
        signal.signal(signal.SIGINT, finish)
        start = time.monotonic()
        print(f"pearl-hold: start at {time.time():.3f}", flush=True)
        while not stop and (self.max_hold_s is None or time.monotonic() - start < self.max_hold_s):
            time.sleep(self.tick_s)
        sys.stdout.flush()
        return stop[0] if stop else "max_hold_s"


Payload = Callable[[], object]
