"""Whether the Slurm job this process runs in is being requeued or ended.

A job that Slurm requeues (``scontrol requeue``, a preemption with requeue) and one that
``scancel`` ends both get SIGTERM; what tells them apart is the job's ``Restarts`` count
in ``scontrol show job``, which a requeue raises at once, while the incarnation it ends
still runs with its own count in ``SLURM_RESTART_COUNT`` (unset in the first). Measured on
the dev cluster: ``scancel`` leaves ``Restarts=0`` in the first incarnation, ``scontrol
requeue`` makes it 1 (both while the job is ``COMPLETING``).

A preemption with a grace time sends SIGTERM when the grace starts and requeues (if the
partition's ``PreemptMode`` says so) only after it: ``PreemptTime`` set, this cannot say
(None), and the caller keeps its elastic jobs. Slurm's warning (``--signal=USR2@...``)
comes before the requeue its handler then asks for, so it says nothing here either: the
caller keeps its elastic jobs on USR2 whatever this says.
"""

from __future__ import annotations

import logging
import os

from pearl.cluster.slurm_backend import SlurmCommandError, run_command
from pearl.cluster.slurm_text import SlurmTextError, parse_restarts, preempted

log = logging.getLogger(__name__)


def requeued(environ: dict[str, str] | None = None) -> bool | None:
    """True if this job is being requeued, False if it is ending for good (cancelled, or
    past its time limit), None outside a Slurm job or when Slurm cannot say."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        shown = run_command(["scontrol", "show", "job", job_id])
        restarts = parse_restarts(shown)
    except (SlurmCommandError, SlurmTextError) as err:
        log.warning("cannot tell whether job %s is requeued: %s", job_id, err)
        return None
    if restarts > int(env.get("SLURM_RESTART_COUNT") or 0):
        return True
    if preempted(shown):  # its requeue, if its partition's PreemptMode has one, comes later
        return None
    return False
