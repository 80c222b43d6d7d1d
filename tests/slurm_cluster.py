"""A module-scoped ``slurm/dev-cluster`` for tests (a plain module, not a conftest).

``dev_cluster`` starts the cluster once under pytest's tmp dir on the ports the module
chooses (``port_base``: every module that starts one passes its own, so clusters never
share ports), points the Slurm clients of this process at it (``SLURM_CONF`` and ``PATH``
in ``os.environ``, because submitit runs ``sbatch`` with the process's environment), and
stops it at the end. Without root or apt the tests skip, unless ``CI`` is set: then they
fail. ``DevCluster`` runs Slurm commands against it; ``wait_for`` polls a condition and
reports the queue on a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "dev-cluster"
GRACE_S = 10  # GraceTime of the elastic partition
PORT_BASE = "20800"  # below the ephemeral range (32768-60999): free_port never takes these
SLURM_TOOLS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch", "sacct")


def cannot_start_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the Slurm dev cluster needs Linux"
    if os.geteuid() != 0:
        return "the Slurm dev cluster needs root (it starts munged, slurmctld, slurmd as root)"
    have_tools = all(shutil.which(t) or Path("/usr/sbin", t).exists() for t in SLURM_TOOLS)
    if not have_tools and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@dataclass
class DevCluster:
    state_dir: Path
    env: dict[str, str]
    work: Path  # working directory of the commands (sbatch's default output lands here)

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
        """Submit; the job id (of a heterogeneous job: its leader's)."""
        return self.run("sbatch", "--parsable", *args).strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """The job's state in ``squeue`` ("" once it has left)."""
        return self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()

    def start_requeued(self, job_id: str) -> None:
        """Start a requeued job without waiting out Slurm's requeue delay (its BeginTime).

        Not at once: the requeue revokes the job's credential on its node, and slurmd
        refuses a credential made in the same second as the revocation ("Job N already
        killed, do not launch batch job"; the job then fails), which the delay avoids."""
        wait_for(lambda: self.job_state(job_id) == "PENDING", 30, "the requeue", self)
        time.sleep(2.0)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def restarts(self, job_id: str) -> int:
        """How many times Slurm has requeued the job and started it again."""
        out = self.run("scontrol", "show", "job", job_id)
        return int(out.split("Restarts=")[1].split()[0]) if "Restarts=" in out else 0

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


def wait_for(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str,
    cluster: DevCluster | None = None,
    poll_s: float = 0.5,
) -> None:
    """Poll until ``predicate()`` holds; on a timeout fail with the queue (if given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    queue = f"\n{cluster.run('squeue', check=False)}" if cluster is not None else ""
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{queue}")


def dev_cluster(
    tmp_path_factory: pytest.TempPathFactory, port_base: str = PORT_BASE
) -> Iterator[DevCluster]:
    """Body of a module-scoped fixture: ``yield from dev_cluster(tmp_path_factory, BASE)``."""
    reason = cannot_start_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the Slurm dev cluster cannot start: {reason}")
        print(f"SKIP slurm dev cluster: {reason}")
        pytest.skip(reason)
    state_dir = tmp_path_factory.mktemp("slurm-dev-cluster")
    env = dict(os.environ)
    env.update(
        PEARL_DEV_CLUSTER_DIR=str(state_dir),
        PEARL_DEV_CLUSTER_PORT_BASE=port_base,
        PEARL_DEV_CLUSTER_GRACE=str(GRACE_S),
        SLURM_CONF=str(state_dir / "etc" / "slurm.conf"),
        PATH=f"/usr/sbin:/sbin:{env.get('PATH', '/usr/bin:/bin')}",
    )
    c = DevCluster(state_dir=state_dir, env=env, work=tmp_path_factory.mktemp("slurm-jobs"))
    t0 = time.monotonic()
    up = subprocess.run([str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(
            f"slurm/dev-cluster up failed ({up.returncode})\n{up.stdout}\n{up.stderr}\n{c.logs()}"
        )
    print(f"dev-cluster up in {time.monotonic() - t0:.1f}s")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", env["SLURM_CONF"])
            mp.setenv("PATH", env["PATH"])
            yield c
    finally:
        down = subprocess.run(
            [str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120
        )
        # The MariaDB datadir is ~100 MB; pytest keeps old tmp dirs around.
        shutil.rmtree(state_dir, ignore_errors=True)
        assert down.returncode == 0, down.stderr
