"""The job payload of an elastic allocation: the node agent, one per node.

submitit runs it once per node (one task per node). It starts ``pearl agent`` under
``mpiexec`` (the agent must be an MPI process to connect to the coordinator; ``-launcher
fork`` keeps Hydra from calling ``srun`` inside the job step) with the node's name
(``SLURMD_NODENAME``), its GPUs (``CUDA_VISIBLE_DEVICES``, as Slurm's gres set it, by
position: ``NODE/0`` is the first device listed, whatever its number on a node without
device cgroups), so the agent registers the same GPU ids the coordinator's state has
(``NODE/INDEX``), and its
job id as the backend names it (the coordinator matches agents to grants by it). The agent
and its engines log to ``RUN_DIR/logs`` (``agent-ID.log``, ``WORKER.log``).

Slurm's warning signal (USR2: preemption with its grace period, or the time limit) and
SIGTERM are forwarded to the agent, which reports, drains its workers and disconnects; the
payload then returns the agent's exit status. When the coordinator goes silent (killed or
requeued, or not reachable: the agent exits ``EXIT_LOST``), the payload keeps the allocation and
starts a new agent as soon as the next coordinator writes a new port file (within
``reconnect_s``), so elastic allocations outlive a coordinator's restart. An agent that
dies otherwise (``kill -9``, a crash: any status but 0, 2 and ``EXIT_LOST``) is started
again at once, at most ``max_agent_restarts`` times: it joins the same coordinator with no
engines (its engines died with it), which frees their GPUs in the state, and the
allocation is kept. It replaces
submitit's USR2 handler, which would requeue the allocation: an elastic allocation that
is taken back is not requeued.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from pearl.control.agent import EXIT_LOST, EXIT_OK, EXIT_REFUSED, agent_command


@dataclass(frozen=True)
class AgentPayload:
    run_dir: str
    gpu_type: str
    engines: tuple[str, ...] = ()  # ROLE=CMD, as ``pearl agent --engine``
    null_workers: bool = False  # record commands without launching engines
    grace_s: float = 30.0
    reconnect_s: float = 600.0  # how long to wait for a requeued coordinator
    engine_host: str = "loopback"  # or "node": engines on the node's name, for other nodes
    max_agent_restarts: int = 3  # of an agent that died (not one the coordinator lost)
    node: str | None = None  # the node's name to the coordinator (None: SLURMD_NODENAME)

    def command(self, node: str, gpus: str, job_id: str | None = None) -> list[str]:
        logs = Path(self.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        options = ["--gpus", gpus, "--gpu-type", self.gpu_type, "--grace-s", str(self.grace_s)]
        options += ["--log-dir", str(logs)]
        if self.engine_host == "node":  # the engines' URLs must be reachable from the router
            options += ["--engine-host", socket.gethostname()]
        if job_id is not None:
            options += ["--job-id", job_id]
        cmd = agent_command(self.run_dir, node, *options)
        for engine in self.engines:
            cmd += ["--engine", engine]
        if self.null_workers:
            cmd.append("--null-workers")
        return cmd

    def __call__(self) -> int:
        node = self.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        # the GPUs by their position in the job's CUDA_VISIBLE_DEVICES (NODE/0, NODE/1: the
        # ids the grant has); the engines' workers map a position back to the device
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        gpus = ",".join(str(i) for i in range(len(visible)))
        procs: list[subprocess.Popen[bytes]] = []
        signalled: list[int] = []

        def forward(signum: int, frame: FrameType | None) -> None:
            signalled.append(signum)
            if procs and procs[-1].poll() is None:
                procs[-1].send_signal(signum)

        for sig in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        port_file = Path(self.run_dir) / "control" / "port.json"
        restarts = 0
        while True:
            if signalled:  # told to go before (or while) starting an agent
                return 0
            seen = _stamp(port_file)
            procs.append(subprocess.Popen(self.command(node, gpus, _job_id())))
            if signalled:  # arrived while starting it: pass it on now
                procs[-1].send_signal(signalled[-1])
            code = procs[-1].wait()
            if signalled:
                return code
            died = code not in (EXIT_OK, EXIT_REFUSED, EXIT_LOST)
            if died and restarts < self.max_agent_restarts:
                restarts += 1
                print(
                    f"agent payload: the agent on {node} died (status {code}): starting "
                    f"another (restart {restarts} of {self.max_agent_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            if code != EXIT_LOST:
                return code
            # The coordinator went silent (killed, or requeued): hold the allocation and
            # connect to the next incarnation once it writes a new port file.
            if not _wait_for_change(port_file, seen, self.reconnect_s, signalled):
                return code


def _job_id() -> str | None:
    """The job this payload runs in, as its backend names it (``backend.job_id``):
    submitit's (Slurm or local), else Slurm's own for a plain sbatch job."""
    try:
        import submitit

        return str(submitit.JobEnvironment().job_id)
    except (ImportError, RuntimeError):
        return os.environ.get("SLURM_JOB_ID")


def _stamp(path: Path) -> tuple[float, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_mtime, st.st_ino)


def _wait_for_change(
    path: Path, seen: tuple[float, int] | None, timeout_s: float, signalled: list[int]
) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not signalled:
        stamp = _stamp(path)
        if stamp is not None and stamp != seen:
            return True
        time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    """``python -m pearl.cluster.agent_payload --run-dir D --gpu-type T``: the same loop
    for jobs not submitted through submitit (``slurm/base-job.sbatch``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pearl.cluster.agent_payload")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--gpu-type", required=True)
    ap.add_argument("--engine", action="append", default=[], metavar="ROLE=CMD")
    ap.add_argument("--null-workers", action="store_true")
    ap.add_argument("--grace-s", type=float, default=30.0)
    ap.add_argument("--reconnect-s", type=float, default=600.0)
    ap.add_argument("--engine-host", choices=("loopback", "node"), default="loopback")
    a = ap.parse_args(argv)
    payload = AgentPayload(
        a.run_dir,
        a.gpu_type,
        tuple(a.engine),
        a.null_workers,
        a.grace_s,
        a.reconnect_s,
        a.engine_host,
    )
    return payload()


if __name__ == "__main__":
    sys.exit(main())
