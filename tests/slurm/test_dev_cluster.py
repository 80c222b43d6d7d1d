"""End-to-end tests of ``slurm/dev-cluster``: a real Slurm 22.05 on this machine.

The module starts the cluster once (state under pytest's tmp dir, its own ports) and
stops it at the end.  Without root or apt the tests skip, unless ``CI`` is set: then
they run and fail loudly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "dev-cluster"
GRACE_S = 10  # GraceTime of the elastic partition (script default)
PORT_BASE = "26800"  # away from the default cluster's ports (16800+)
SLURM_TOOLS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch", "sacct")


def _cannot_start_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the Slurm dev cluster needs Linux"
    if os.geteuid() != 0:
        return "the Slurm dev cluster needs root (it starts munged, slurmctld, slurmd as root)"
    have_tools = all(shutil.which(t) or Path("/usr/sbin", t).exists() for t in SLURM_TOOLS)
    if not have_tools and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@dataclass
class Cluster:
    state_dir: Path
    env: dict[str, str]
    work: Path

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> str:
        proc = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.work
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc.stdout

    def sbatch(self, *args: str) -> str:
        return self.run("sbatch", "--parsable", *args).strip().split(";")[0]

    def sacct_state(self, job_id: str) -> str:
        out = self.run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State", check=False)
        return out.strip().splitlines()[0].split()[0] if out.strip() else ""

    def wait_sacct(self, job_id: str, states: set[str], timeout: float = 40) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.sacct_state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(
            f"job {job_id}: sacct state {state!r}, wanted one of {sorted(states)}\n"
            + self.run("scontrol", "show", "job", job_id, check=False)
        )

    def logs(self) -> str:
        parts = []
        for log in sorted((self.state_dir / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def _wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = _cannot_start_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the Slurm dev cluster cannot start: {reason}")
        print(f"SKIP slurm dev cluster: {reason}")
        pytest.skip(reason)

    state_dir = tmp_path_factory.mktemp("slurm-dev-cluster")
    work = tmp_path_factory.mktemp("slurm-jobs")
    env = dict(os.environ)
    env.update(
        PEARL_DEV_CLUSTER_DIR=str(state_dir),
        PEARL_DEV_CLUSTER_PORT_BASE=PORT_BASE,
        PEARL_DEV_CLUSTER_GRACE=str(GRACE_S),
        SLURM_CONF=str(state_dir / "etc" / "slurm.conf"),
        PATH=f"/usr/sbin:/sbin:{env.get('PATH', '/usr/bin:/bin')}",
    )
    c = Cluster(state_dir=state_dir, env=env, work=work)
    t0 = time.monotonic()
    up = subprocess.run([str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(
            f"slurm/dev-cluster up failed ({up.returncode})\n{up.stdout}\n{up.stderr}\n{c.logs()}"
        )
    print(f"dev-cluster up in {time.monotonic() - t0:.1f}s")
    try:
        yield c
    finally:
        down = subprocess.run(
            [str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120
        )
        assert down.returncode == 0, down.stderr
        # The MariaDB datadir is ~100 MB; pytest keeps old tmp dirs around.
        shutil.rmtree(state_dir, ignore_errors=True)


def test_status_reports_all_daemons(cluster: Cluster) -> None:
    out = cluster.run(str(SCRIPT), "status")
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd h20-1"):
        assert f"{daemon}" in out
    assert "DOWN" not in out


def test_sinfo_partitions_and_gpu_types(cluster: Cluster) -> None:
    out = cluster.run("sinfo", "-h", "-o", "%R|%G|%t")
    rows = [line.split("|") for line in out.split()]
    assert {r[0] for r in rows} == {"train", "elastic", "owner"}
    gres = " ".join(r[1] for r in rows)
    assert "gpu:h800:" in gres
    assert "gpu:h20:" in gres
    assert {r[2] for r in rows} <= {"idle", "mix", "alloc"}, out


@pytest.fixture(scope="module")
def gpu_job(cluster: Cluster) -> tuple[str, str]:
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


def test_sacct_reports_finished_job(cluster: Cluster, gpu_job: tuple[str, str]) -> None:
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


def test_owner_preempts_elastic_after_grace_with_signal(cluster: Cluster) -> None:
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
    _wait_for(lambda: _events(user_sig) and _events(plain), 20, "the elastic jobs to start")
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


def test_srun_mpi_pmi2_two_ranks_on_two_nodes(cluster: Cluster) -> None:
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
