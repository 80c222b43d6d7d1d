"""Elastic allocations on this machine, for machines without Slurm: submitit's LocalExecutor.

Each allocation is one local submitit job running ``payload`` (by default
``HoldAllocation``) with ``CUDA_VISIBLE_DEVICES`` set to the requested count. It is granted
at once on one node, ``localhost``, with the requested number of GPUs of the requested
type (nothing checks that the machine has them), ends at its time limit
(``timeout_min``), when its process ends, or when released (submitit sends SIGINT).
End reasons: ``released``, ``completed`` (exit status 0), ``failed`` (any other exit),
``cancelled`` (killed by a signal from elsewhere). No preemption here.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import submitit

from pearl.cluster.backend import AllocationTracker, HoldAllocation, JobSnapshot, Payload
from pearl.core.decision import ElasticRequest
from pearl.core.observation import Event

LOCAL_NODE = "localhost"


class LocalBackend:
    """``AllocationBackend`` on submitit's LocalExecutor (see the module doc)."""

    def __init__(
        self,
        folder: str | Path,
        *,
        payload: Payload | None = None,
        signal_delay_s: int = 60,
    ) -> None:
        self.folder = Path(folder)
        self.payload: Payload = payload if payload is not None else HoldAllocation()
        self.signal_delay_s = signal_delay_s
        self._tracker = AllocationTracker()
        self._jobs: dict[str, submitit.Job[Any]] = {}
        self._requests: dict[str, ElasticRequest] = {}
        self._granted_end_by_s: dict[str, float] = {}

    def submit(self, request: ElasticRequest, allocation_id: str) -> None:
        executor = submitit.LocalExecutor(folder=self.folder / "%j")
        executor.update_parameters(
            timeout_min=request.time_limit_min,
            gpus_per_node=request.num_gpus,
            tasks_per_node=1,
            signal_delay_s=self.signal_delay_s,
        )
        self._tracker.add(allocation_id, request, gpus_per_node=request.num_gpus)
        self._jobs[allocation_id] = executor.submit(self.payload)
        self._requests[allocation_id] = request

    def reattach(self, request: ElasticRequest, allocation_id: str) -> bool:
        """A local job cannot be found again by a restarted coordinator."""
        return False

    def poll(self, now_s: float) -> list[Event]:
        return self._tracker.update(self._snapshot(a, now_s) for a in self._tracker.active())

    def release(self, allocation_id: str) -> None:
        if allocation_id not in self._tracker.active():
            return
        self._tracker.mark_released(allocation_id)
        job = self._jobs[allocation_id]
        job.cancel(check=False)  # SIGINT to submitit's local controller, and SIGTERM, which
        if not job.done():  # it forwards to the task: a process started in the background
            with contextlib.suppress(ProcessLookupError):  # of a shell ignores SIGINT
                os.kill(int(job.job_id), signal.SIGTERM)

    def close(self) -> None:
        for allocation_id in self._tracker.active():
            self.release(allocation_id)

    def job_id(self, allocation_id: str) -> str:
        return str(self._jobs[allocation_id].job_id)

    def _snapshot(self, allocation_id: str, now_s: float) -> JobSnapshot:
        job = self._jobs[allocation_id]
        end_by = self._granted_end_by_s.setdefault(
            allocation_id, now_s + 60.0 * self._requests[allocation_id].time_limit_min
        )
        return JobSnapshot(
            allocation_id=allocation_id,
            state=_state(job),
            nodes=(LOCAL_NODE,),
            end_by_s=end_by,
        )


def _state(job: submitit.Job[Any]) -> str:
    """submitit's local job state as a Slurm state name."""
    state = job.state
    if state == "RUNNING":
        return "RUNNING"
    if state == "INTERRUPTED":  # killed by a signal
        return "CANCELLED"
    # FINISHED: the controller process exited; its status tells success from failure.
    process = getattr(job, "_process", None)
    code = process.poll() if process is not None else None
    return "COMPLETED" if code == 0 else "FAILED"
