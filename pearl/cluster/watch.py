"""Slurm's view of pearl's jobs as ``JobSnapshot`` values: pure, no subprocess, no clock.

The Slurm backend runs one ``squeue`` per poll interval for the run's jobs and ``sacct``
only for jobs that left ``squeue``; this module turns their text into snapshots. Wall-clock
times from Slurm (local time, naive) become run-clock seconds through ``RunClock``.

What Slurm 22.05 lets us observe of a preemption (checked on ``slurm/dev-cluster``,
PreemptMode=CANCEL, GraceTime=10 s, ``preempt_send_user_signal``):
- the job stays ``RUNNING`` in ``squeue`` for the whole grace period, with reason ``None``;
  there is no state or reason that says "preempting";
- its end time (``squeue %e``, ``scontrol``'s ``EndTime``) moves from start + time limit to
  PreemptTime + GraceTime the moment the preemptor is scheduled (``scontrol show job`` also
  shows ``PreemptTime``, which ``squeue`` cannot print with ``--format``);
- the job steps get the ``--signal`` signal (USR2 from submitit) at the same moment;
- at the end of the grace period the job is ``COMPLETING`` briefly, then leaves ``squeue``;
  ``sacct`` says ``PREEMPTED`` (or ``FAILED``/``COMPLETED`` when the payload exited on the
  signal before the grace ended).
So a running job whose end time is earlier than start + time limit is being preempted,
with its deadline at that end time. A job that left ``squeue`` is looked up in ``sacct``.

``SQUEUE_FORMAT`` carries the end time (``%e``) and the time limit (``%l``) for this.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pearl.cluster.backend import JobSnapshot
from pearl.cluster.slurm_text import (
    SacctRow,
    SqueueRow,
    expand_hostlist,
    parse_time,
)

SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,Start,End,NodeList"
_PREEMPT_SLACK_S = 1.0  # Slurm's times have whole seconds


@dataclass(frozen=True)
class RunClock:
    """Maps Slurm's wall-clock datetimes to the run clock: ``run_s = wall_s + offset_s``."""

    offset_s: float

    @classmethod
    def at(cls, now_s: float, wall_now_s: float) -> RunClock:
        return cls(now_s - wall_now_s)

    def run_s(self, when: datetime | None) -> float | None:
        return None if when is None else when.timestamp() + self.offset_s


def snapshot_of_squeue(row: SqueueRow, allocation_id: str, clock: RunClock) -> JobSnapshot:
    running = row.state in ("RUNNING", "SIGNALING")
    return JobSnapshot(
        allocation_id=allocation_id,
        state=row.state,
        nodes=row.nodes if row.state != "PENDING" else (),
        end_by_s=clock.run_s(row.end) if row.state != "PENDING" else None,
        preempt_deadline_s=clock.run_s(row.end) if running and _preempted(row) else None,
        pending_reason=row.reason if row.state == "PENDING" else None,
        start_estimate_s=clock.run_s(row.start) if row.state == "PENDING" else None,
    )


def _preempted(row: SqueueRow) -> bool:
    """Slurm moved the end before start + time limit: a preemption's grace period."""
    start, end, limit = row.start, row.end, row.time_limit_s
    if start is None or end is None or limit is None:
        return False
    return (end - start).total_seconds() < limit - _PREEMPT_SLACK_S


def snapshot_of_sacct(row: SacctRow, allocation_id: str, clock: RunClock) -> JobSnapshot:
    """A job that left ``squeue``: its final (or, while slurmdbd lags, last known) state."""
    nodes_text = row.fields.get("NodeList", "")
    nodes = () if nodes_text in ("", "None assigned", "(null)") else expand_hostlist(nodes_text)
    end = parse_time(row.fields.get("End", ""))
    return JobSnapshot(
        allocation_id=allocation_id,
        state=row.state,
        nodes=nodes,
        end_by_s=clock.run_s(end),
    )


@dataclass
class PollGate:
    """At most one Slurm query per ``interval_s`` of the run clock."""

    interval_s: float
    last_s: float | None = None

    def due(self, now_s: float) -> bool:
        if self.last_s is not None and now_s - self.last_s < self.interval_s:
            return False
        self.last_s = now_s
        return True
