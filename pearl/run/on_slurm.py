"""``pearl run`` with ``cluster: slurm``: elastic allocations are Slurm jobs with node agents.

The run itself is one Slurm job (``slurm/pearl-run.sbatch``, or ``pearl run --submit``
through submitit; docs/slurm-run.md): it holds the trainer's and the base rollout's
devices and runs what a local run runs (router, rollout manager, the trainer's process,
the base engines, the coordinator's loop). What changes is where elastic devices come
from: ``decide()``'s requests go to ``SlurmBackend`` (``policy.elastic``: partition, GPU
type, GPUs, time limit), each grant runs a node agent per node (``AgentPayload``) that
starts the run's engines (``engines.backend``: reference or vLLM) on the node's GPUs when
a plan says so, and the plans reach those
agents over MPI (``pearl.run.split_control``). A grant counts once its agents have joined;
one taken back by its owner is drained within ``slurm.grace_s``.

A run stopped by a signal (Slurm's warning before a requeue or the time limit, SIGTERM)
keeps its elastic jobs for the next incarnation, which replays the journal and finds them
by name (``pearl-RUN_ID-el0001``); a run that ends releases them.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pearl.coordinator.config import AgentSection
from pearl.run.config import RunConfig
from pearl.run.engine_command import engine_section

if TYPE_CHECKING:
    from pearl.cluster.slurm_backend import SlurmBackend


def run_id(config: RunConfig, run_dir: Path) -> str:
    """The tag of the run's Slurm jobs: ``slurm.run_id``, or the run directory's name and a
    hash of its path (two runs in folders of the same name must not take each other's
    jobs for theirs: a requeued run finds its elastic jobs by name)."""
    if config.slurm.run_id is not None:
        return config.slurm.run_id
    tag = re.sub(r"[^A-Za-z0-9_.-]", "-", run_dir.name).lstrip("-_.")[:50] or "run"
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{tag}-{digest}"


def agent_section(config: RunConfig, model: Path) -> AgentSection:
    """The elastic nodes' agents: engines of the run's model, started as the run's own
    are (``pearl.run.engine_command``)."""
    s = config.slurm
    return AgentSection(  # the router is in the run's job: on another node, on a cluster
        engine=engine_section(config, model),
        engine_host="node",
        grace_s=s.grace_s,
        join_timeout_s=s.join_timeout_s,
    )


def slurm_backend(config: RunConfig, run_dir: Path, model: Path) -> SlurmBackend:
    """Elastic allocations as Slurm jobs, each with a node agent per node."""
    from pearl.cluster.agent_payload import AgentPayload
    from pearl.cluster.slurm_backend import SlurmBackend  # submitit: the slurm extra

    s = config.slurm
    agents = agent_section(config, model)
    gpu_type = config.coordinator.policy_config().elastic.gpu_type
    engines = agents.engine_commands(sys.executable)
    payload = AgentPayload(
        str(run_dir),
        gpu_type,
        engines,
        grace_s=agents.grace_s,
        reconnect_s=s.reconnect_s,
        engine_host=agents.engine_host,
    )
    return SlurmBackend(
        run_id(config, run_dir),
        run_dir / "elastic-jobs",
        dict(s.gpus_per_node),
        s.poll_interval_s,
        qos=s.qos,
        payload=payload,
    )
