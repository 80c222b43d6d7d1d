"""A pearl command as a requeueable submitit job: the run (``pearl run --submit``) and the
bare coordinator (``launch/submit.py --coordinator``) are submitted this way from a login
node.

The job runs ``python -m pearl.cli.main ARGV`` as a child process. When Slurm warns it
(the time limit, or a preemption; ``--signal=USR2@signal_delay_s``), submitit calls
``checkpoint``: the child is told (USR2: it stops cleanly, keeping its elastic jobs) and
given ``stop_wait_s`` to do so, then the job is requeued with the same arguments and the
next incarnation resumes from the run directory (journal, checkpoints, spool).

A child killed by a signal it could not handle (``kill -9``, the kernel's OOM killer, a
crash: ``RESTART_SIGNALS``) is started again in the same allocation, from the same run
directory, at most ``max_restarts`` times per incarnation: the run resumes from its books
as after a requeue, without waiting for Slurm. A child that exits by itself (0, or its own
status for a failure, or ``128+N`` for a signal it handled) or dies of another signal
(a SIGTERM before it set its handlers: ``scancel`` during its start) ends the job with
that status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission
from submitit.slurm.slurm import _make_sbatch_string

# the deaths a child is restarted after: killed (kill -9, the OOM killer) or crashed
RESTART_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT})
REQUEUE_MARGIN_S = 20.0  # of the warning, left for submitit's requeue after the child stops


class ChildJob(Checkpointable):
    """``pearl ARGV`` under submitit, requeued with the same arguments (module docstring)."""

    def __init__(self, stop_wait_s: float = 60.0, max_restarts: int = 3) -> None:
        self.stop_wait_s, self.max_restarts = stop_wait_s, max_restarts
        self._child: subprocess.Popen[bytes] | None = None
        self._stopping = False  # checkpoint() told the child to stop

    def command(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "pearl.cli.main", *argv]

    def __call__(self, *argv: str) -> int:
        for restart in range(self.max_restarts + 1):
            self._child = subprocess.Popen(self.command(*argv))
            code = self._child.wait()
            if not restarts_after(code) or self._stopping or restart == self.max_restarts:
                break
            why = signal.Signals(-code).name
            print(
                f"pearl {argv[0]} killed by {why}: starting it again from its run directory "
                f"(restart {restart + 1} of {self.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
        if code != 0:
            raise RuntimeError(f"pearl {argv[0]} exited with status {code}")
        return code

    def checkpoint(self, *argv: str) -> DelayedSubmission:
        child = self._child
        self._stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGUSR2)
            try:
                child.wait(timeout=self.stop_wait_s)
            except subprocess.TimeoutExpired:
                child.kill()
        return DelayedSubmission(ChildJob(self.stop_wait_s, self.max_restarts), *argv)


def restarts_after(code: int) -> bool:
    """Whether a child that ended with ``code`` (``Popen``'s: -N for signal N) is restarted."""
    return code < 0 and -code in {s.value for s in RESTART_SIGNALS}


@dataclass(frozen=True)
class JobSpec:
    """The Slurm job of one incarnation."""

    name: str
    partition: str
    time_limit_min: int
    signal_delay_s: int
    folder: Path
    max_requeues: int = 100
    cpus_per_task: int = 1
    gres: str | None = None


def executor(spec: JobSpec) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(
        folder=spec.folder, cluster="slurm", slurm_max_num_timeout=spec.max_requeues
    )
    extra: dict[str, Any] = {"requeue": True}
    if spec.gres is not None:
        extra["gres"] = spec.gres
    ex.update_parameters(
        name=spec.name,
        slurm_partition=spec.partition,
        timeout_min=spec.time_limit_min,
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=spec.cpus_per_task,
        slurm_signal_delay_s=spec.signal_delay_s,
        slurm_additional_parameters=extra,
    )
    return ex


def sbatch_script(spec: JobSpec) -> str:
    """The sbatch script submitit would write for ``spec`` (``--dry-run``)."""
    params = executor(spec)._executor.parameters  # submitit keeps them there
    command = "python -m submitit.core._submit FOLDER"
    return str(_make_sbatch_string(command=command, folder=str(spec.folder), **params))


def submit(spec: JobSpec, *argv: str) -> str:
    """Submit ``pearl ARGV`` as ``spec``'s job; its Slurm job id. The child has the
    warning's time less a margin to stop, so that the requeue lands before the limit."""
    stop_wait_s = max(1.0, spec.signal_delay_s - REQUEUE_MARGIN_S)
    job = executor(spec).submit(ChildJob(stop_wait_s), *argv)
    return str(job.job_id)
