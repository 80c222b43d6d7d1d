"""Elastic allocations on Slurm: submitted with submitit, watched with squeue and sacct.

One allocation is one job (``pearl.cluster.submission``): job name ``pearl-RUN-ALLOCATION``
and comment ``pearl:run=RUN,...``, so the run's jobs can be found by name. The job runs
``payload`` once per node (submitit, one task per node): the node agent's
``AgentPayload``, or ``HoldAllocation`` for a coordinator without agents.

Watching (``poll``): at most one ``squeue --noheader --format=SQUEUE_FORMAT
--name=<the run's active job names>`` per ``poll_interval_s`` of the run clock, plus one
``sacct -X --parsable2 -j <ids>`` in the same poll for the jobs that left ``squeue`` (to
learn how they ended). A poll closer than ``poll_interval_s`` to the last query runs no
subprocess and returns only the events queued since (``AllocationPending`` of new
submissions). Nothing is polled while no allocation is active. submitit's own watcher
(``SlurmInfoWatcher``) is not used: it is a class-level singleton on ``time.time()`` and
polls ``sacct`` alone, which knows neither the pending reason nor the preemption's end.

Preemption is read from the end time that Slurm moves to the end of the grace period (see
``pearl.cluster.watch``). GPU types come from the request: the job asks for typed gres
(``gpu:TYPE:N``), so every granted node has ``min(gpus_per_node, num_gpus)`` GPUs of it.

All Slurm commands go through ``runner`` (argv -> stdout; raises ``SlurmCommandError``), so
tests can count or replace them; submission goes through submitit's ``sbatch`` call.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError

from pearl.cluster.backend import (
    AllocationConfigError,
    AllocationTracker,
    HoldAllocation,
    JobSnapshot,
    Payload,
)
from pearl.cluster.slurm_text import SQUEUE_FORMAT, SlurmTextError, parse_sacct, parse_squeue
from pearl.cluster.submission import Submission, submitit_parameters
from pearl.cluster.watch import (
    SACCT_FIELDS,
    PollGate,
    RunClock,
    snapshot_of_sacct,
    snapshot_of_squeue,
)
from pearl.core.decision import ElasticRequest
from pearl.core.observation import Event

Runner = Callable[[Sequence[str]], str]
_ALREADY_GONE = re.compile(r"already completing or completed|invalid job id", re.I)
COMMAND_TIMEOUT_S = 30.0


class SlurmCommandError(RuntimeError):
    pass


def run_command(argv: Sequence[str]) -> str:
    """The default runner: run a Slurm client command, return its stdout."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmCommandError(f"{argv[0]}: {err}") from err
    if proc.returncode != 0:
        raise SlurmCommandError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


# sbatch's complaint -> the config field that caused it (first match wins).
_REFUSALS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"invalid partition", re.I), "policy.elastic.partition", "partition"),
    (re.compile(r"\bqos\b", re.I), "policy.elastic.qos", "QOS"),
    (re.compile(r"time limit", re.I), "policy.elastic.time_limit_min", "time limit"),
    (
        re.compile(r"gres|generic resource|node configuration is not available", re.I),
        "policy.elastic.gpu_type",
        "GPU request",
    ),
)


def refusal_error(submission: Submission, sbatch_message: str) -> Exception:
    """The clear error for an sbatch refusal, naming the config field when it is known."""
    message = " ".join(sbatch_message.split()) or "sbatch failed without a message"
    values = {
        "policy.elastic.partition": submission.request.partition,
        "policy.elastic.qos": submission.qos,
        "policy.elastic.time_limit_min": submission.request.time_limit_min,
        "policy.elastic.gpu_type": submitit_parameters(submission)["gres"],
    }
    for pattern, field_name, what in _REFUSALS:
        if pattern.search(message):
            value = values[field_name]
            return AllocationConfigError(
                field_name, value, f"Slurm refused {what} {value!r}: {message}"
            )
    return SlurmCommandError(f"sbatch refused {submission.job_name}: {message}")


class SlurmBackend:
    """``AllocationBackend`` on Slurm (see the module doc)."""

    def __init__(
        self,
        run_id: str,
        folder: str | Path,
        gpus_per_node_by_type: dict[str, int],
        poll_interval_s: float = 5.0,
        *,
        qos: str | None = None,
        signal_delay_s: int = 60,
        payload: Payload | None = None,
        runner: Runner = run_command,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_id = run_id
        self.folder = Path(folder)
        self.gpus_per_node_by_type = dict(gpus_per_node_by_type)
        self.qos = qos
        self.signal_delay_s = signal_delay_s
        self.payload: Payload = payload if payload is not None else HoldAllocation()
        self._run = runner
        self._wall_clock = wall_clock
        self._gate = PollGate(poll_interval_s)
        self._tracker = AllocationTracker()
        self._job_ids: dict[str, str] = {}  # allocation id -> Slurm job id
        self._names: dict[str, str] = {}  # allocation id -> job name
        self.poll_errors = 0  # failed squeue/sacct queries (retried next interval)
        self.last_poll_error: str | None = None

    # ----------------------------------------------------------------- interface ---

    def submit(self, request: ElasticRequest, allocation_id: str) -> None:
        gpus_per_node = self.gpus_per_node_by_type.get(request.gpu_type)
        if gpus_per_node is None:
            known = ", ".join(sorted(self.gpus_per_node_by_type)) or "none"
            raise AllocationConfigError(
                "policy.elastic.gpu_type",
                request.gpu_type,
                f"no GPUs per node known for type {request.gpu_type!r} (known: {known})",
            )
        s = Submission(
            run_id=self.run_id,
            allocation_id=allocation_id,
            request=request,
            gpus_per_node=gpus_per_node,
            qos=self.qos,
            signal_delay_s=self.signal_delay_s,
        )
        executor = submitit.SlurmExecutor(folder=self.folder / "%j")
        executor.update_parameters(**submitit_parameters(s))
        try:
            # submitit echoes sbatch's stderr; the refusal is reported once, below
            with contextlib.redirect_stderr(io.StringIO()):
                job = executor.submit(self.payload)
        except FailedJobError as err:
            raise refusal_error(s, str(err)) from err
        self._track(s, str(job.job_id))

    def adopt(self, request: ElasticRequest, allocation_id: str, job_id: str) -> None:
        """Watch a job this run submitted earlier (a requeued coordinator found it by its
        comment, ``run_of_comment``) as if ``submit`` had just made it."""
        s = Submission(
            run_id=self.run_id,
            allocation_id=allocation_id,
            request=request,
            gpus_per_node=self.gpus_per_node_by_type.get(request.gpu_type, request.num_gpus),
            qos=self.qos,
            signal_delay_s=self.signal_delay_s,
        )
        self._track(s, job_id)

    def reattach(self, request: ElasticRequest, allocation_id: str) -> bool:
        """Find the job a previous incarnation submitted for ``allocation_id`` by its job
        name and watch it: in ``squeue`` first (slurmctld knows a job at once; accounting
        may lag), then in accounting (a job that ended meanwhile). False when Slurm has
        no such job."""
        name = f"pearl-{self.run_id}-{allocation_id}"
        queries = (
            ["squeue", "--noheader", "--format=%i", f"--name={name}"],
            [
                "sacct",
                "-X",
                "--noheader",
                "--parsable2",
                "--format=JobID",
                f"--name={name}",
                "--starttime=2000-01-01",
            ],
        )
        for query in queries:
            try:
                out = self._run(list(query))
            except SlurmCommandError:
                continue
            ids = [line.strip() for line in out.splitlines() if line.strip()]
            if ids:
                self.adopt(request, allocation_id, ids[-1])
                return True
        return False

    def _track(self, s: Submission, job_id: str) -> None:
        self._tracker.add(s.allocation_id, s.request, s.gpus_per_node)
        self._job_ids[s.allocation_id] = job_id
        self._names[s.allocation_id] = s.job_name

    def poll(self, now_s: float) -> list[Event]:
        active = self._tracker.active()
        if not active or not self._gate.due(now_s):
            return self._tracker.update(())
        clock = RunClock.at(now_s, self._wall_clock())
        try:
            snapshots = self._snapshots(active, clock)
        except (SlurmCommandError, SlurmTextError) as err:
            # slurmctld busy or an odd answer: keep what we know, ask again next interval.
            self.poll_errors += 1
            self.last_poll_error = str(err)
            snapshots = []
        return self._tracker.update(snapshots)

    def release(self, allocation_id: str) -> None:
        if allocation_id not in self._tracker.active():
            return
        self._tracker.mark_released(allocation_id)
        try:
            self._run(["scancel", self._job_ids[allocation_id]])
        except SlurmCommandError as err:
            if not _ALREADY_GONE.search(str(err)):
                raise

    def close(self) -> None:
        for allocation_id in self._tracker.active():
            if not self._tracker.is_released(allocation_id):
                self.release(allocation_id)

    # ------------------------------------------------------------------ queries ---

    def job_id(self, allocation_id: str) -> str:
        return self._job_ids[allocation_id]

    def last_snapshot(self, allocation_id: str) -> JobSnapshot | None:
        """The latest view of the job: pending reason and start estimate while pending."""
        return self._tracker.last_snapshot(allocation_id)

    def _snapshots(self, active: list[str], clock: RunClock) -> list[JobSnapshot]:
        by_job = {self._job_ids[a]: a for a in active}
        names = ",".join(self._names[a] for a in active)
        out = self._run(["squeue", "--noheader", f"--format={SQUEUE_FORMAT}", f"--name={names}"])
        snapshots = []
        for job in parse_squeue(out):
            allocation_id = by_job.get(str(job.job_id.job))
            if allocation_id is not None and job.job_id.step is None:
                snapshots.append(snapshot_of_squeue(job, allocation_id, clock))
        seen = {s.allocation_id for s in snapshots}
        gone = [j for j, a in by_job.items() if a not in seen]
        if gone:
            snapshots += self._sacct(gone, by_job, clock)
        return snapshots

    def _sacct(
        self, job_ids: list[str], by_job: dict[str, str], clock: RunClock
    ) -> list[JobSnapshot]:
        out = self._run(
            [
                "sacct",
                "-X",
                "--parsable2",
                f"--format={SACCT_FIELDS}",
                f"--jobs={','.join(job_ids)}",
            ]
        )
        rows = parse_sacct(out)
        return [
            snapshot_of_sacct(r, by_job[str(r.job_id.job)], clock)
            for r in rows
            if str(r.job_id.job) in by_job and r.job_id.step is None
        ]
