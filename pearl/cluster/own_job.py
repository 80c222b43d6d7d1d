"""Whether the Slurm job this process runs in is being requeued or ended.

A job that Slurm requeues (``scontrol requeue``, a preemption with requeue) and one that
``scancel`` ends both get SIGTERM; what tells them apart is the job's ``Restarts`` count
in ``scontrol show job``, which a requeue raises at once, while the incarnation it ends
still runs with its own count in ``SLURM_RESTART_COUNT`` (unset in the first). Measured on
the dev cluster: ``scancel`` leaves ``Restarts=0`` in the first incarnation, ``scontrol
requeue`` makes it 1 (both while the job is ``COMPLETING``).

Slurm's warning (``--signal=USR2@...``) comes before the requeue its handler then asks
for, so it says nothing here: the caller keeps its elastic jobs on USR2 whatever this
says.
"""

from __future__ import annotations

import logging
import os

from pearl.cluster.slurm_backend import SlurmCommandError, run_command
from pearl.cluster.slurm_text import SlurmTextError, parse_restarts

log = logging.getLogger(__name__)


def requeued(environ: dict[str, str] | None = None) -> bool | None:
    """True if this job is being requeued, False if it is ending for good (cancelled, or
    past its time limit), None outside a Slurm job or when Slurm cannot say."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        restarts = parse_restarts(run_command(["scontrol", "show", "job", job_id]))
    except (SlurmCommandError, SlurmTextError) as err:
        log.warning("cannot tell whether job %s is requeued: %s", job_id, err)
        return None
    return restarts > int(env.get("SLURM_RESTART_COUNT") or 0)
