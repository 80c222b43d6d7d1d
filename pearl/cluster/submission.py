"""What an elastic request becomes on Slurm: submitit parameters, and the same as sbatch
options. Pure; the Slurm backend passes the parameters to ``submitit.SlurmExecutor``.

One request is one job of whole nodes: ``num_gpus`` of ``gpu_type`` over
``ceil(num_gpus / gpus_per_node)`` nodes, one task per node (the node agent), the GPUs as
typed gres (``gpu:TYPE:N``), the time limit from the config, the job name and comment
tagged with the run id (so ``squeue``/``sacct`` can be filtered by run and a restarted
coordinator finds its jobs), and Slurm's warning signal ``signal_delay_s`` before the
time limit (the agent drains on it; preemption sends the same signal with the
partition's GraceTime).

Invariants: the job name is ``pearl-RUN-ALLOCATION``; the comment starts with
``pearl:run=RUN``; ``sbatch_options`` renders exactly the submitit parameters.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pearl.core.decision import ElasticRequest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # no shell or comment separators
COMMENT_PREFIX = "pearl:run="


@dataclass(frozen=True)
class Submission:
    run_id: str
    allocation_id: str
    request: ElasticRequest
    gpus_per_node: int
    qos: str | None = None
    signal_delay_s: int = 60

    def __post_init__(self) -> None:
        for field, value in (("run_id", self.run_id), ("allocation_id", self.allocation_id)):
            if not _NAME.match(value):
                raise ValueError(f"{field}: {value!r} must be letters, digits, '_', '.', '-'")
        if self.gpus_per_node < 1 or self.request.num_gpus < 1:
            raise ValueError("num_gpus and gpus_per_node must be >= 1")

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.request.num_gpus / self.gpus_per_node)

    @property
    def job_name(self) -> str:
        return f"pearl-{self.run_id}-{self.allocation_id}"

    @property
    def comment(self) -> str:
        return f"{COMMENT_PREFIX}{self.run_id},allocation={self.allocation_id}"


def submitit_parameters(s: Submission) -> dict[str, Any]:
    """Keyword arguments of ``submitit.SlurmExecutor.update_parameters``."""
    params: dict[str, Any] = {
        "job_name": s.job_name,
        "partition": s.request.partition,
        "nodes": s.num_nodes,
        "ntasks_per_node": 1,
        "gres": f"gpu:{s.request.gpu_type}:{min(s.gpus_per_node, s.request.num_gpus)}",
        "time": s.request.time_limit_min,
        "comment": s.comment,
        "signal_delay_s": s.signal_delay_s,
    }
    if s.qos is not None:
        params["qos"] = s.qos
    return params


def sbatch_options(s: Submission) -> list[str]:
    """The same job as ``#SBATCH`` options (``slurm/*.sbatch`` and tests)."""
    p = submitit_parameters(s)
    options = [
        f"--job-name={p['job_name']}",
        f"--partition={p['partition']}",
        f"--nodes={p['nodes']}",
        f"--ntasks-per-node={p['ntasks_per_node']}",
        f"--gres={p['gres']}",
        f"--time={p['time']}",
        f"--comment={p['comment']}",
        f"--signal=USR2@{p['signal_delay_s']}",
    ]
    if "qos" in p:
        options.append(f"--qos={p['qos']}")
    return options


def run_of_comment(comment: str) -> tuple[str, str] | None:
    """(run id, allocation id) of a job pearl submitted, from its comment; else None."""
    if not comment.startswith(COMMENT_PREFIX):
        return None
    run, _, rest = comment[len(COMMENT_PREFIX) :].partition(",allocation=")
    return (run, rest) if run and rest else None
