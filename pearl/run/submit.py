"""The run's own Slurm job: ``pearl run CONFIG --cluster slurm --submit`` and
``launch/submit.py CONFIG`` submit ``pearl run CONFIG --cluster slurm`` with submitit
(``pearl.cluster.child_job``), as ``slurm/pearl-run.sbatch`` does with sbatch.

The job is named ``pearl-base`` (it holds the base job's devices: the trainer's and the
base rollout's; ``pearl analyze --sacct-query`` counts them so) and takes the config's
``slurm.job`` section: partition, gres, CPUs, time limit, warning, requeues.
"""

from __future__ import annotations

from pathlib import Path

from pearl.analysis.accounting import BASE_JOB_NAME
from pearl.cluster.child_job import JobSpec
from pearl.run.config import load_run_config


def run_job_spec(config_path: str, folder: Path) -> tuple[JobSpec, tuple[str, ...]]:
    """The run job of the configuration at ``config_path`` and the command it runs."""
    config, _ = load_run_config(config_path)
    j = config.slurm.job
    spec = JobSpec(
        name=BASE_JOB_NAME,
        partition=j.partition,
        time_limit_min=j.time_limit_min,
        signal_delay_s=j.signal_delay_s,
        folder=folder,
        max_requeues=j.max_requeues,
        cpus_per_task=j.cpus_per_task,
        gres=j.gres,
    )
    return spec, ("run", config_path, "--cluster", "slurm", "--json")
