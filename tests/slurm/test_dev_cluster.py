"""End-to-end tests of ``slurm/dev-cluster``: a real Slurm 22.05 on this machine.

The module starts the cluster once (state under pytest's tmp dir, its own ports) and
stops it at the end.  Without root or apt the tests skip, unless ``CI`` is set: then
they run and fail loudly.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import GRACE_S, SCRIPT, DevCluster, dev_cluster, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    yield from dev_cluster(tmp_path_factory, port_base="26800")


def test_status_reports_all_daemons(cluster: DevCluster) -> None:
    out = cluster.run(str(SCRIPT), "status")
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd h20-1"):
        assert f"{daemon}" in out
    assert "DOWN" not in out


def test_sinfo_partitions_and_gpu_types(cluster: DevCluster) -> None:
    out = cluster.run("sinfo", "-h", "-o", "%R|%G|%t")
    rows = [line.split("|") for line in out.split()]
    assert {r[0] for r in rows} == {"train", "elastic", "owner"}
    gres = " ".join(r[1] for r in rows)
    assert "gpu:h800:" in gres
    assert "gpu:h20:" in gres
    assert {r[2] for r in rows} <= {"idle", "mix", "alloc"}, out


@pytest.fixture(scope="module")
def gpu_job(cluster: DevCluster) -> tuple[str, str]:
    out_file = cluster.work / "gpu-job.out"
    job_id = cluster.sbatch(
        "-p",
        "elastic",
        "--gres=gpu:h20:1",
        "-o",
        str(out_file),
        "--wrap",
        'echo "node=$SLURMD_NODENAME cvd=${CUDA_VISIBLE_DEVICES:-UNSET}"',
    )
    cluster.wait_sacct(job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    return job_id, out_file.read_text()


def test_h20_gpu_job_sees_cuda_visible_devices(gpu_job: tuple[str, str]) -> None:
    _, out = gpu_job
    assert "node=h20-" in out, out
    assert "cvd=UNSET" not in out, out
    assert "cvd=0" in out, out


def test_sacct_reports_finished_job(cluster: DevCluster, gpu_job: tuple[str, str]) -> None:
    job_id, _ = gpu_job
    out = cluster.run(
        "sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,AllocTRES"
    )
    fields = out.strip().split("|")
    assert fields[:3] == [job_id, "COMPLETED", "0:0"], out
    assert "gres/gpu:h20=1" in fields[3], out


HANDLER = textwrap.dedent(
    """\
    import signal, sys, time
    out = sys.argv[1]
    def note(what):
        with open(out, "a") as f:
            f.write(f"{what} {time.time()}\\n")
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, lambda sig, frame: note(signal.Signals(sig).name))
    note("START")
    while True:
        time.sleep(0.05)
    """
)


def _events(path: Path) -> list[tuple[str, float]]:
    if not path.exists():
        return []
    return [(w, float(t)) for w, t in (line.split() for line in path.read_text().splitlines())]


def test_owner_preempts_elastic_after_grace_with_signal(cluster: DevCluster) -> None:
    work = cluster.work
    handler = work / "handler.py"
    handler.write_text(HANDLER)
    user_sig, plain = work / "user-signal.txt", work / "plain.txt"
    owner_out = work / "owner.txt"
    py = sys.executable
    # On h20-1: the batch script itself handles signals and asked for USR2
    # (``--signal=B:USR2``, like submitit): preempt_send_user_signal sends it at the
    # start of GraceTime.  On h20-2: no --signal, a job step gets SIGTERM.
    job_sig = cluster.sbatch(
        "-p", "elastic", "-w", "h20-1", "--exclusive", "--signal=B:USR2@600", "-t", "30",
        "-o", "/dev/null", "--wrap", f"exec {py} {handler} {user_sig}",
    )  # fmt: skip
    job_plain = cluster.sbatch(
        "-p", "elastic", "-w", "h20-2", "--exclusive", "-t", "30",
        "-o", "/dev/null", "--wrap", f"srun {py} {handler} {plain}",
    )  # fmt: skip
    wait_for(lambda: _events(user_sig) and _events(plain), 20, "the elastic jobs to start")
    owner = cluster.sbatch(
        "-p", "owner", "-N2", "--exclusive", "-t", "5", "-o", "/dev/null",
        "--wrap", f"{py} -c 'import time; print(time.time())' > {owner_out}",
    )  # fmt: skip
    submitted = time.time()
    cluster.wait_sacct(owner, {"COMPLETED"}, timeout=GRACE_S + 25)
    owner_started = float(owner_out.read_text())

    for job_id, path, first_signal in (
        (job_sig, user_sig, "SIGUSR2"),
        (job_plain, plain, "SIGTERM"),
    ):
        events = _events(path)
        names = [w for w, _ in events]
        assert names[0] == "START", events
        assert len(names) >= 2 and names[1] == first_signal, (job_id, events)
        signalled = events[1][1]
        assert signalled >= submitted - 1, (job_id, events)
        # The preemptor waited for the grace time after the signal.
        assert owner_started - signalled >= GRACE_S - 1, (job_id, events, owner_started)
        assert cluster.sacct_state(job_id) == "PREEMPTED"


OWN_JOB = """
import signal, sys, time
from pathlib import Path
from pearl.cluster.own_job import requeued
out = Path(sys.argv[1])
def on_term(signum, frame):
    out.write_text(str(requeued()))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
out.with_suffix(".started").write_text("1")
time.sleep(120)
"""


def test_a_job_tells_a_requeue_from_a_cancel(cluster: DevCluster) -> None:
    """All three get SIGTERM; ``pearl.cluster.own_job.requeued`` tells a requeue (True)
    from a cancel (False), and says it cannot tell (None) for a preemption in its grace
    time (Slurm requeues only after, if the partition's PreemptMode says so): the run
    keeps its elastic jobs unless it is cancelled."""
    script = cluster.work / "own_job.py"
    script.write_text(OWN_JOB)
    kinds = ("cancel", "requeue", "preempt")
    outs = {what: cluster.work / f"own-job-{what}.txt" for what in kinds}
    train = ("-p", "train", "--requeue", "-t", "5", "-o", "/dev/null", "--wrap")
    elastic = ("-p", "elastic", "-w", "h20-1", "--exclusive", "--requeue", "-t", "5", "-o")
    elastic = (*elastic, "/dev/null", "--wrap")
    jobs = {
        what: cluster.sbatch(
            *(elastic if what == "preempt" else train),
            f"exec {sys.executable} {script} {out}",
        )
        for what, out in outs.items()
    }
    started = [out.with_suffix(".started") for out in outs.values()]
    wait_for(lambda: all(p.exists() for p in started), 30, "the jobs to start", cluster)
    owner = ("-p", "owner", "-w", "h20-1", "--exclusive", "-t", "1", "-o", "/dev/null")
    cluster.sbatch(*owner, "--wrap", "sleep 1")  # takes the node back
    cluster.run("scancel", jobs["cancel"])
    cluster.run("scontrol", "requeue", jobs["requeue"])
    wait_for(lambda: all(p.exists() for p in outs.values()), GRACE_S + 30, "the SIGTERMs", cluster)
    told = {w: p.read_text() for w, p in outs.items()}
    assert told == {"cancel": "False", "requeue": "True", "preempt": "None"}
    cluster.run("scancel", jobs["requeue"], jobs["preempt"])  # not needed again


def test_srun_mpi_pmi2_two_ranks_on_two_nodes(cluster: DevCluster) -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("mpi4py is not installed (pip install -e '.[slurm]')")
    code = (
        "from mpi4py import MPI; import os; c = MPI.COMM_WORLD; "
        "print(c.Get_rank(), c.Get_size(), os.environ['SLURMD_NODENAME'], flush=True)"
    )
    out = cluster.run(
        "srun", "--mpi=pmi2", "-p", "train", "-N2", "-n2", "-t", "1", sys.executable, "-c", code,
        timeout=60,
    )  # fmt: skip
    rows = sorted(line.split() for line in out.strip().splitlines())
    assert [r[:2] for r in rows] == [["0", "2"], ["1", "2"]], out
    assert len({r[2] for r in rows}) == 2, out
