"""Allocation backends: the pure tracker and Slurm watch, then the real thing.

- ``AllocationTracker`` and ``pearl.cluster.watch``: snapshot sequences and recorded
  ``squeue``/``sacct`` text (lines as Slurm 22.05 printed them on the dev cluster) in,
  exact event lists out; no Slurm.
- ``SlurmBackend`` with a fake runner (the one faked edge: Slurm's client commands) for the
  poll rate and the sbatch refusal mapping.
- ``SlurmBackend`` on ``slurm/dev-cluster`` (module scope; skips without root unless ``CI``):
  grant and release, preemption by the owner partition, a bad partition, the poll rate.
- ``LocalBackend``: submit, grant, release, end.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path

import pytest
from slurm_cluster import GRACE_S, DevCluster, dev_cluster

from pearl.cluster.backend import (
    AllocationBackend,
    AllocationConfigError,
    AllocationTracker,
    HoldAllocation,
    JobSnapshot,
    end_reason,
)
from pearl.cluster.local_backend import LocalBackend
from pearl.cluster.slurm_backend import SlurmBackend, refusal_error, run_command
from pearl.cluster.slurm_text import SQUEUE_FORMAT, parse_sacct, parse_squeue
from pearl.cluster.submission import Submission
from pearl.cluster.watch import (
    PollGate,
    RunClock,
    snapshot_of_sacct,
    snapshot_of_squeue,
)
from pearl.core.decision import ElasticRequest
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    Event,
    GrantedNode,
)

H20 = ElasticRequest(num_gpus=2, gpu_type="h20", partition="elastic", time_limit_min=5)
H20_X4 = ElasticRequest(num_gpus=4, gpu_type="h20", partition="elastic", time_limit_min=10)


# ---------------------------------------------------------------- pure tracker ---


def _tracker(*allocations: tuple[str, ElasticRequest]) -> AllocationTracker:
    t = AllocationTracker()
    for aid, req in allocations:
        t.add(aid, req, gpus_per_node=2)
    return t


def test_tracker_pending_granted_preempting_preempted_once_each() -> None:
    t = _tracker(("a", H20_X4))
    pending = JobSnapshot("a", "PENDING", pending_reason="Resources", start_estimate_s=30.0)
    running = JobSnapshot("a", "RUNNING", nodes=("h20-1", "h20-2"), end_by_s=700.0)
    preempting = JobSnapshot("a", "RUNNING", nodes=("h20-1", "h20-2"), preempt_deadline_s=60.0)
    ended = JobSnapshot("a", "PREEMPTED", nodes=("h20-1", "h20-2"))
    granted = AllocationGranted(
        allocation_id="a",
        nodes=(GrantedNode(node="h20-1", gpu_type="h20", num_gpus=2),
               GrantedNode(node="h20-2", gpu_type="h20", num_gpus=2)),
        end_by_s=700.0,
    )  # fmt: skip
    assert t.update([pending]) == [AllocationPending(allocation_id="a", gpu_type="h20", num_gpus=4)]
    assert t.update([pending]) == []
    assert t.update([running]) == [granted]
    assert t.update([running, running]) == []
    assert t.update([preempting]) == [AllocationPreempting(allocation_id="a", deadline_s=60.0)]
    assert t.update([preempting]) == []
    assert t.update([ended]) == [AllocationEnded(allocation_id="a", reason="preempted")]
    assert t.update([ended, running, preempting]) == []
    assert t.active() == []


def test_tracker_job_started_before_first_poll_gets_pending_then_granted() -> None:
    t = _tracker(("a", H20))
    events = t.update([JobSnapshot("a", "RUNNING", nodes=("h20-2",), end_by_s=300.0)])
    assert [e.kind for e in events] == ["allocation_pending", "allocation_granted"]
    assert isinstance(events[1], AllocationGranted)
    assert events[1].nodes == (GrantedNode(node="h20-2", gpu_type="h20", num_gpus=2),)


def test_tracker_keeps_snapshot_order_across_allocations_and_ignores_strangers() -> None:
    t = _tracker(("a", H20), ("b", H20))
    assert [e.allocation_id for e in t.update([])] == ["a", "b"]
    events = t.update(
        [
            JobSnapshot("b", "RUNNING", nodes=("h20-1",)),
            JobSnapshot("zzz", "RUNNING", nodes=("h20-2",)),  # not ours
            JobSnapshot("a", "WEIRD_NEW_STATE", nodes=("h20-2",)),  # unknown: no event
            JobSnapshot("a", "CANCELLED"),  # ended while pending: no grant
        ]
    )
    assert events == [
        AllocationGranted(
            allocation_id="b", nodes=(GrantedNode(node="h20-1", gpu_type="h20", num_gpus=2),)
        ),
        AllocationEnded(allocation_id="a", reason="cancelled"),
    ]


def test_tracker_preempting_needs_a_grant_and_is_not_reported_after_release() -> None:
    t = _tracker(("a", H20), ("b", H20))
    t.update([])
    # A pending job cannot be preempting; the grant comes first within the same snapshot.
    both = JobSnapshot("a", "RUNNING", nodes=("h20-1",), preempt_deadline_s=12.0)
    assert [e.kind for e in t.update([both])] == ["allocation_granted", "allocation_preempting"]
    t.update([JobSnapshot("b", "RUNNING", nodes=("h20-2",))])
    t.mark_released("b")
    # scancel moves the end time too; that is not a preemption.
    assert t.update([JobSnapshot("b", "RUNNING", nodes=("h20-2",), preempt_deadline_s=5.0)]) == []
    assert t.update([JobSnapshot("b", "CANCELLED")]) == [
        AllocationEnded(allocation_id="b", reason="released")
    ]


def test_tracker_rejects_a_second_submission_of_one_allocation() -> None:
    t = _tracker(("a", H20))
    with pytest.raises(ValueError, match="already submitted"):
        t.add("a", H20, gpus_per_node=2)


@pytest.mark.parametrize(
    ("state", "released", "preempting", "reason"),
    [
        pytest.param("PREEMPTED", False, False, "preempted", id="slurm-preempted"),
        pytest.param("PREEMPTED", True, False, "preempted", id="preempted-beats-released"),
        pytest.param("TIMEOUT", False, True, "timeout", id="timeout"),
        pytest.param("NODE_FAIL", True, False, "node_fail", id="node-fail"),
        pytest.param("FAILED", False, True, "preempted", id="exited-on-the-warning"),
        pytest.param("CANCELLED", True, False, "released", id="released"),
        pytest.param("CANCELLED", False, False, "cancelled", id="cancelled-by-someone"),
        pytest.param("COMPLETED", False, False, "completed", id="completed"),
        pytest.param("COMPLETED", True, False, "released", id="released-payload-returned"),
        pytest.param("OUT_OF_MEMORY", False, False, "failed", id="oom"),
        pytest.param("FAILED", False, False, "failed", id="failed"),
    ],
)
def test_end_reason(state: str, released: bool, preempting: bool, reason: str) -> None:
    assert end_reason(state, released=released, preempting=preempting) == reason


# ---------------------------------------------------------------- Slurm watch ---

T0 = datetime(2026, 11, 29, 12, 2, 41)  # job start in the recorded lines below
CLOCK = RunClock(100.0 - T0.timestamp())  # the run clock read 100 s at the job's start
# squeue --noheader --format=SQUEUE_FORMAT on Slurm 22.05 (dev cluster), one job:
SQUEUE_PENDING = "3|PENDING|Resources|2026-11-29T12:02:43||elastic|pearl-r-a|N/A|10:00\n"
SQUEUE_RUNNING = (
    "3|RUNNING|None|2026-11-29T12:02:41|h20-[1-2]|elastic|pearl-r-a|2026-11-29T12:12:41|10:00\n"
)
# ... two seconds after an owner job was scheduled on its nodes (GraceTime=10):
SQUEUE_GRACE = (
    "3|RUNNING|None|2026-11-29T12:02:41|h20-[1-2]|elastic|pearl-r-a|2026-11-29T12:02:53|10:00\n"
)
SACCT_PREEMPTED = (
    "JobID|State|ExitCode|Elapsed|Start|End|NodeList\n"
    "3|PREEMPTED|0:0|00:00:14|2026-11-29T12:02:41|2026-11-29T12:02:55|h20-[1-2]\n"
)


def test_squeue_lines_become_snapshots_with_preemption_from_the_end_time() -> None:
    (pending,) = parse_squeue(SQUEUE_PENDING)
    (running,) = parse_squeue(SQUEUE_RUNNING)
    (grace,) = parse_squeue(SQUEUE_GRACE)
    assert snapshot_of_squeue(pending, "a", CLOCK) == JobSnapshot(
        "a", "PENDING", pending_reason="Resources", start_estimate_s=102.0
    )
    assert snapshot_of_squeue(running, "a", CLOCK) == JobSnapshot(
        "a", "RUNNING", nodes=("h20-1", "h20-2"), end_by_s=700.0
    )
    assert snapshot_of_squeue(grace, "a", CLOCK) == JobSnapshot(
        "a", "RUNNING", nodes=("h20-1", "h20-2"), end_by_s=112.0, preempt_deadline_s=112.0
    )
    (row,) = parse_sacct(SACCT_PREEMPTED)
    assert snapshot_of_sacct(row, "a", CLOCK) == JobSnapshot(
        "a", "PREEMPTED", nodes=("h20-1", "h20-2"), end_by_s=114.0
    )


def test_recorded_preemption_gives_the_exact_events() -> None:
    t = _tracker(("a", H20_X4))
    polls = [SQUEUE_PENDING, SQUEUE_RUNNING, SQUEUE_RUNNING, SQUEUE_GRACE, SQUEUE_GRACE]
    events: list[Event] = []
    for text in polls:
        events += t.update(snapshot_of_squeue(j, "a", CLOCK) for j in parse_squeue(text))
    events += t.update([snapshot_of_sacct(parse_sacct(SACCT_PREEMPTED)[0], "a", CLOCK)])
    two = GrantedNode(node="h20-1", gpu_type="h20", num_gpus=2)
    assert events == [
        AllocationPending(allocation_id="a", gpu_type="h20", num_gpus=4),
        AllocationGranted(
            allocation_id="a",
            nodes=(two, two.model_copy(update={"node": "h20-2"})),
            end_by_s=700.0,
        ),
        AllocationPreempting(allocation_id="a", deadline_s=112.0),
        AllocationEnded(allocation_id="a", reason="preempted"),
    ]


def test_poll_gate_lets_one_query_through_per_interval() -> None:
    gate = PollGate(interval_s=2.0)
    assert [gate.due(t) for t in (0.0, 0.5, 1.99, 2.0, 2.1, 4.5)] == [
        True, False, False, True, False, True,
    ]  # fmt: skip


def _refusal(message: str, partition: str = "elastic", gpu_type: str = "h20") -> Exception:
    req = ElasticRequest(num_gpus=2, gpu_type=gpu_type, partition=partition, time_limit_min=5)
    return refusal_error(Submission("r", "a", req, gpus_per_node=2, qos="low"), message)


def test_sbatch_refusals_name_the_config_field() -> None:
    # Messages as sbatch 22.05 prints them on the dev cluster.
    err = _refusal(
        "sbatch: error: invalid partition specified: nope\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified",
        partition="nope",
    )
    assert isinstance(err, AllocationConfigError)
    assert str(err).startswith("policy.elastic.partition: Slurm refused partition 'nope': ")
    err = _refusal(
        "sbatch: error: Batch job submission failed: Requested node configuration is not available",
        gpu_type="a100",
    )
    assert isinstance(err, AllocationConfigError)
    assert err.field_name == "policy.elastic.gpu_type"
    assert "'gpu:a100:2'" in str(err)
    err = _refusal("sbatch: error: Batch job submission failed: Invalid qos specification")
    assert isinstance(err, AllocationConfigError)
    assert err.field_name == "policy.elastic.qos"
    err = _refusal("sbatch: error: Batch job submission failed: Socket timed out")
    assert not isinstance(err, AllocationConfigError)
    assert "Socket timed out" in str(err)


class FakeSlurm:
    """The faked edge: Slurm's client commands (squeue, sacct, scancel). Counts calls."""

    def __init__(self, squeue: str = "", sacct: str = "JobID|State\n") -> None:
        self.squeue, self.sacct = squeue, sacct
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        return {"squeue": self.squeue, "sacct": self.sacct}.get(argv[0], "")

    def count(self, command: str) -> int:
        return sum(1 for c in self.calls if c[0] == command)


def _fake_backend(tmp_path: Path, fake: FakeSlurm, job_id: str = "3") -> SlurmBackend:
    """A SlurmBackend whose one allocation 'a' is job ``job_id`` (no sbatch)."""
    b = SlurmBackend("r", tmp_path, {"h20": 2}, poll_interval_s=5.0, runner=fake)
    b.adopt(H20_X4, "a", job_id)
    return b


def test_poll_rate_is_bounded_without_slurm(tmp_path: Path) -> None:
    fake = FakeSlurm(squeue=SQUEUE_RUNNING)
    b = _fake_backend(tmp_path, fake)
    events: list[Event] = []
    for i in range(1000):  # 0 .. 9.99 s of run clock
        events += b.poll(i * 0.01)
    assert fake.count("squeue") == 2  # at 0 s and 5 s
    assert [e.kind for e in events] == ["allocation_pending", "allocation_granted"]
    assert fake.calls[0] == [
        "squeue", "--noheader", f"--format={SQUEUE_FORMAT}", "--name=pearl-r-a",
    ]  # fmt: skip
    # The job left squeue: one sacct in the next due poll tells how it ended.
    fake.squeue, fake.sacct = "", SACCT_PREEMPTED
    assert b.poll(10.0) == [AllocationEnded(allocation_id="a", reason="preempted")]
    assert fake.count("sacct") == 1
    assert b.poll(20.0) == []  # nothing active: no query
    assert len(fake.calls) == 4


def test_poll_survives_a_failing_squeue(tmp_path: Path) -> None:
    def failing(argv: Sequence[str]) -> str:
        return run_command(["false"])

    b = SlurmBackend("r", tmp_path, {"h20": 2}, runner=failing)
    b.adopt(H20, "a", "3")
    assert [e.kind for e in b.poll(0.0)] == ["allocation_pending"]
    assert b.poll_errors == 1
    assert b.last_poll_error is not None and "exited 1" in b.last_poll_error


def test_unknown_gpu_type_is_a_config_error_before_sbatch(tmp_path: Path) -> None:
    b = SlurmBackend("r", tmp_path, {"h20": 2}, runner=FakeSlurm())
    with pytest.raises(AllocationConfigError, match=r"^policy\.elastic\.gpu_type: .*'a100'"):
        b.submit(ElasticRequest(2, "a100", "elastic", 5), "a")


# ---------------------------------------------------------------- real Slurm ---


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    yield from dev_cluster(tmp_path_factory)


class Clock:
    """The run clock of a test: seconds since it was made."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


def _poll_until(
    backend: AllocationBackend,
    clock: Clock,
    want: Callable[[Event], bool],
    timeout_s: float,
    seen: list[Event],
) -> Event:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in backend.poll(clock()):
            seen.append(event)
            if want(event):
                return event
        time.sleep(0.1)
    raise AssertionError(f"no such event within {timeout_s}s; saw {seen}")


def _wait_payload_started(folder: Path, job_id: str, timeout_s: float = 20) -> None:
    """The payload has replaced submitit's USR2 handler (a preemption earlier kills it)."""
    out = folder / job_id / f"{job_id}_0_log.out"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out.exists() and "pearl-hold: start" in out.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"payload of job {job_id} did not start: {out}")


def _kind(kind: str) -> Callable[[Event], bool]:
    return lambda e: e.kind == kind


def test_slurm_grant_then_release(slurm: DevCluster, tmp_path: Path) -> None:
    clock = Clock()
    b = SlurmBackend("t1", tmp_path, {"h20": 2, "h800": 4}, poll_interval_s=0.5)
    assert isinstance(b, AllocationBackend)
    b.submit(H20, "grant")
    seen: list[Event] = []
    granted = _poll_until(b, clock, _kind("allocation_granted"), 30, seen)
    assert seen[0] == AllocationPending(allocation_id="grant", gpu_type="h20", num_gpus=2)
    assert isinstance(granted, AllocationGranted)
    (node,) = granted.nodes
    assert node.node in ("h20-1", "h20-2") and node.gpu_type == "h20" and node.num_gpus == 2
    assert granted.end_by_s is not None
    assert 5 * 60 - 10 < granted.end_by_s - clock() <= 5 * 60 + 1
    name, comment = (
        slurm.run("squeue", "--noheader", "--format=%j|%k", "-j", b.job_id("grant"))
        .strip()
        .split("|")
    )
    assert (name, comment) == ("pearl-t1-grant", "pearl:run=t1,allocation=grant")
    b.release("grant")
    ended = _poll_until(b, clock, _kind("allocation_ended"), 30, seen)
    assert ended == AllocationEnded(allocation_id="grant", reason="released")
    assert [e.kind for e in seen] == [
        "allocation_pending",
        "allocation_granted",
        "allocation_ended",
    ]
    b.close()


def test_slurm_owner_preempts_elastic_after_grace(slurm: DevCluster, tmp_path: Path) -> None:
    clock = Clock()
    b = SlurmBackend("t2", tmp_path, {"h20": 2}, poll_interval_s=0.5)
    b.submit(H20, "victim")
    seen: list[Event] = []
    granted = _poll_until(b, clock, _kind("allocation_granted"), 30, seen)
    assert isinstance(granted, AllocationGranted)
    _wait_payload_started(tmp_path, b.job_id("victim"))
    node = granted.nodes[0].node
    slurm.run(
        "sbatch", "-p", "owner", "--gres=gpu:h20:2", "-w", node, "-t", "1", "-o", "/dev/null",
        "--wrap", "sleep 30",
    )  # fmt: skip
    asked = clock()
    preempting = _poll_until(b, clock, _kind("allocation_preempting"), 10, seen)
    assert isinstance(preempting, AllocationPreempting)
    # The deadline is the end of the grace period (whole seconds on Slurm's side).
    assert asked + GRACE_S - 2 <= preempting.deadline_s <= clock() + GRACE_S + 1
    ended = _poll_until(b, clock, _kind("allocation_ended"), GRACE_S + 15, seen)
    assert ended == AllocationEnded(allocation_id="victim", reason="preempted")
    assert clock() >= preempting.deadline_s - 1  # it lived through the grace period
    assert [e.kind for e in seen] == [
        "allocation_pending", "allocation_granted", "allocation_preempting", "allocation_ended",
    ]  # fmt: skip
    b.close()


def test_slurm_bad_partition_is_a_clear_config_error(slurm: DevCluster, tmp_path: Path) -> None:
    b = SlurmBackend("t3", tmp_path, {"h20": 2})
    with pytest.raises(AllocationConfigError) as info:
        b.submit(ElasticRequest(2, "h20", "nope", 5), "bad")
    assert str(info.value).startswith("policy.elastic.partition: Slurm refused partition 'nope': ")
    assert "invalid partition" in str(info.value).lower()
    b2 = SlurmBackend("t3", tmp_path, {"a100": 2})  # a type the cluster does not have
    with pytest.raises(AllocationConfigError, match=r"^policy\.elastic\.gpu_type: "):
        b2.submit(ElasticRequest(2, "a100", "elastic", 5), "bad")
    assert b.poll(0.0) == [] and b2.poll(0.0) == []


def test_slurm_poll_rate_is_bounded(slurm: DevCluster, tmp_path: Path) -> None:
    calls: list[str] = []

    def counting(argv: Sequence[str]) -> str:
        calls.append(argv[0])
        return run_command(argv)

    clock = Clock()
    b = SlurmBackend("t4", tmp_path, {"h20": 2}, poll_interval_s=1.0, runner=counting)
    b.submit(H20, "rate")
    start = clock()
    polls = 0
    while clock() - start < 2.5:
        b.poll(clock())
        polls += 1
    assert polls > 1000
    assert calls.count("squeue") == 3  # at 0, 1 and 2 s
    b.close()
    assert calls.count("scancel") == 1


# ---------------------------------------------------------------- local ---


def test_local_backend_grant_release_end(tmp_path: Path) -> None:
    clock = Clock()
    b = LocalBackend(tmp_path)
    assert isinstance(b, AllocationBackend)
    b.submit(H20, "loc")
    events = b.poll(clock())
    assert events[0] == AllocationPending(allocation_id="loc", gpu_type="h20", num_gpus=2)
    granted = events[1]
    assert isinstance(granted, AllocationGranted) and len(events) == 2
    assert granted.nodes == (GrantedNode(node="localhost", gpu_type="h20", num_gpus=2),)
    assert granted.end_by_s == pytest.approx(clock() + 300, abs=1)
    assert b.poll(clock()) == []
    b.release("loc")
    seen: list[Event] = []
    ended = _poll_until(b, clock, _kind("allocation_ended"), 15, seen)
    assert ended == AllocationEnded(allocation_id="loc", reason="released")
    assert b.poll(clock()) == []


def test_local_backend_releases_a_job_that_ignores_sigint(tmp_path: Path) -> None:
    """A coordinator started in the background of a shell ignores SIGINT, and so do the
    jobs it submits: submitit's cancel (SIGINT) alone would leave the job running. The
    release ends it all the same."""
    clock = Clock()
    b = LocalBackend(tmp_path)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the job
    try:
        b.submit(H20, "bg")
    finally:
        signal.signal(signal.SIGINT, previous)
    seen: list[Event] = []
    _poll_until(b, clock, _kind("allocation_granted"), 15, seen)
    time.sleep(1.0)  # the job's task is running
    b.release("bg")
    ended = _poll_until(b, clock, _kind("allocation_ended"), 15, seen)
    assert ended == AllocationEnded(allocation_id="bg", reason="released")


def test_local_backend_payload_that_returns_completes(tmp_path: Path) -> None:
    clock = Clock()
    b = LocalBackend(tmp_path, payload=HoldAllocation(max_hold_s=0.5))
    b.submit(H20, "short")
    seen: list[Event] = []
    ended = _poll_until(b, clock, _kind("allocation_ended"), 15, seen)
    assert ended == AllocationEnded(allocation_id="short", reason="completed")
    assert [e.kind for e in seen] == [
        "allocation_pending",
        "allocation_granted",
        "allocation_ended",
    ]


def test_hold_allocation_returns_on_sigterm() -> None:
    code = (
        "import os, signal, threading;"
        "from pearl.cluster.backend import HoldAllocation;"
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGUSR2)).start();"
        "threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start();"
        "print(HoldAllocation()())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("pearl-hold: start")
    assert lines[1].startswith("pearl-hold: SIGUSR2")
    assert lines[2].startswith("pearl-hold: SIGTERM")
    assert lines[-1] == "SIGTERM"
