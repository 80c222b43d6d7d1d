"""A module-scoped ``slurm/dev-cluster`` for tests (a plain module, not a conftest).

The minimal part of ``tests/slurm/test_dev_cluster.py``'s fixture: start the cluster once
under pytest's tmp dir on its own ports (``PORT_BASE``, away from that module's 26800 so
both can run side by side), point the Slurm clients of this process at it (``SLURM_CONF``
and ``PATH`` in ``os.environ``, because submitit runs ``sbatch`` with the process's
environment), and stop it at the end. Without root or apt the tests skip, unless ``CI``
is set: then they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "dev-cluster"
GRACE_S = 10  # GraceTime of the elastic partition
PORT_BASE = "36800"
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

    def run(self, *cmd: str, timeout: float = 60) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout

    def logs(self) -> str:
        parts = []
        for log in sorted((self.state_dir / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def dev_cluster(
    tmp_path_factory: pytest.TempPathFactory, port_base: str = PORT_BASE
) -> Iterator[DevCluster]:
    """Body of a module-scoped fixture: ``yield from dev_cluster(tmp_path_factory)``; each
    module that starts one passes its own ``port_base`` so clusters never share ports."""
    reason = cannot_start_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the Slurm dev cluster cannot start: {reason}")
        pytest.skip(reason)
    state_dir = tmp_path_factory.mktemp("slurm-backend-cluster")
    env = dict(os.environ)
    env.update(
        PEARL_DEV_CLUSTER_DIR=str(state_dir),
        PEARL_DEV_CLUSTER_PORT_BASE=port_base,
        PEARL_DEV_CLUSTER_GRACE=str(GRACE_S),
        SLURM_CONF=str(state_dir / "etc" / "slurm.conf"),
        PATH=f"/usr/sbin:/sbin:{env.get('PATH', '/usr/bin:/bin')}",
    )
    c = DevCluster(state_dir=state_dir, env=env)
    t0 = time.monotonic()
    up = subprocess.run([str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"slurm/dev-cluster up failed ({up.returncode})\n{up.stderr}\n{c.logs()}")
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
        shutil.rmtree(state_dir, ignore_errors=True)
        assert down.returncode == 0, down.stderr
