"""Submit pearl's persistent coordinator from a login node, with submitit.

    python launch/submit.py CONFIG [--partition train] [--time-min 1440] [--folder DIR]

The coordinator runs as a checkpointable submitit job: when Slurm warns it (time limit
or preemption; ``--signal=USR2@signal_delay_s``), submitit calls ``checkpoint``, which
tells the coordinator (a child process) to stop after its tick and waits for it, and
then requeues the job with the same arguments; the new incarnation replays the run's
journal (``pearl coordinator``). A coordinator killed anyway loses nothing: its journal
is fsync'd before every action.

Prints the Slurm job id. ``--dry-run`` prints the sbatch script submitit would write.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission


class CoordinatorJob(Checkpointable):
    """``pearl coordinator CONFIG`` under submitit; requeued with the same arguments.

    On Slurm's warning submitit calls ``checkpoint``: the coordinator is told (USR2) and
    given ``stop_wait_s`` to finish its tick before the job is requeued and killed.
    """

    def __init__(self, stop_wait_s: float = 60.0) -> None:
        self.stop_wait_s = stop_wait_s
        self._child: subprocess.Popen[bytes] | None = None

    def __call__(self, config: str) -> int:
        cmd = [sys.executable, "-m", "pearl.cli.main", "coordinator", config]
        self._child = subprocess.Popen(cmd)
        code = self._child.wait()
        if code != 0:
            raise RuntimeError(f"pearl coordinator exited with status {code}")
        return code

    def checkpoint(self, config: str) -> DelayedSubmission:
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGUSR2)
            try:
                child.wait(timeout=self.stop_wait_s)
            except subprocess.TimeoutExpired:
                child.kill()
        return DelayedSubmission(CoordinatorJob(self.stop_wait_s), config)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="coordinator configuration (YAML or JSON)")
    p.add_argument("--partition", default="train", help="partition of the coordinator job")
    p.add_argument("--time-min", type=int, default=1440, help="time limit of one incarnation")
    p.add_argument("--signal-delay-s", type=int, default=120, help="warning before the limit")
    p.add_argument("--folder", type=Path, default=Path("runs/coordinator-jobs"))
    p.add_argument("--max-requeues", type=int, default=100, help="incarnations at most")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script only")
    return p.parse_args(argv)


def executor(args: argparse.Namespace) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(
        folder=args.folder, cluster="slurm", slurm_max_num_timeout=args.max_requeues
    )
    ex.update_parameters(
        name=f"pearl-coordinator-{args.config.stem}",
        slurm_partition=args.partition,
        timeout_min=args.time_min,
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=1,
        slurm_signal_delay_s=args.signal_delay_s,
        slurm_additional_parameters={"requeue": True},
    )
    return ex


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = str(args.config.resolve())
    if not args.config.exists():
        print(f"{args.config}: (document): no such file", file=sys.stderr)
        return 2
    ex = executor(args)
    if args.dry_run:
        params = ex._executor.parameters  # submitit keeps them there
        script = submitit.slurm.slurm._make_sbatch_string(
            command="python -m submitit.core._submit FOLDER", folder=str(args.folder), **params
        )
        print(script)
        return 0
    job = ex.submit(CoordinatorJob(), config)
    print(job.job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
