"""Submit a pearl run from a login node, with submitit.

    python launch/submit.py CONFIG [--folder DIR] [--dry-run]
    python launch/submit.py --coordinator CONFIG [--partition train] [--time-min 1440]

The first form submits ``pearl run CONFIG --cluster slurm`` as the run's job, with the
partition, gres, CPUs and time limit of the config's ``slurm.job`` section (the same as
``pearl run CONFIG --cluster slurm --submit``). The second submits the bare coordinator
(``pearl coordinator CONFIG``, a coordinator configuration), with the partition and time
limit given here.

Either is a checkpointable submitit job (``pearl.cluster.child_job``): when Slurm warns it
(time limit or preemption; ``--signal=USR2@signal_delay_s``), the child is told to stop
cleanly, and the job is requeued with the same arguments; the next incarnation resumes
from the run directory. A job killed anyway loses nothing: the journal is fsync'd before
every action, a batch is consumed only once its update is committed.

Prints the Slurm job id. ``--dry-run`` prints the sbatch script submitit would write.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pearl.cluster.child_job import JobSpec, sbatch_script, submit
from pearl.io.documents import InputError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("config", type=Path, help="run configuration (YAML or JSON)")
    p.add_argument(
        "--coordinator", action="store_true", help="CONFIG is a coordinator's: submit it bare"
    )
    p.add_argument("--partition", default="train", help="--coordinator: the job's partition")
    p.add_argument("--time-min", type=int, default=1440, help="--coordinator: time limit")
    p.add_argument("--signal-delay-s", type=int, default=120, help="--coordinator: warning")
    p.add_argument("--folder", type=Path, default=Path("runs/jobs"), help="submitit's folder")
    p.add_argument("--max-requeues", type=int, default=100, help="incarnations at most")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script only")
    return p.parse_args(argv)


def coordinator_spec(args: argparse.Namespace) -> JobSpec:
    return JobSpec(
        name=f"pearl-coordinator-{args.config.stem}",
        partition=args.partition,
        time_limit_min=args.time_min,
        signal_delay_s=args.signal_delay_s,
        folder=args.folder,
        max_requeues=args.max_requeues,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.config.exists():
        print(f"{args.config}: (document): no such file", file=sys.stderr)
        return 2
    config = str(args.config.resolve())
    if args.coordinator:
        spec, command = coordinator_spec(args), ("coordinator", config)
    else:
        from pearl.run.submit import run_job_spec

        try:
            spec, command = run_job_spec(config, args.folder)
        except InputError as err:
            print(err, file=sys.stderr)
            return 2
    if args.dry_run:
        print(sbatch_script(spec))
        return 0
    print(submit(spec, *command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
