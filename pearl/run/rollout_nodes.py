"""The base rollout's own nodes: component 1 of the run's heterogeneous job.

With ``slurm.rollout`` set, the run's job is heterogeneous (``slurm/pearl-run.sbatch``
submitted with a second component; submitit cannot submit one): component 0 runs ``pearl
run`` (the trainer's slots and the job's own rollout slots, as without it), component 1 is
``slurm.rollout.nodes`` nodes of ``slurm.rollout.gpu_type``, each running a node agent
(``pearl run CONFIG --rollout-agent``, one task per node: ``AgentPayload`` with the run's
engine command). The coordinator's base job has them as rollout nodes ``rollout-1`` ..
``rollout-N`` (the agent on the step's node ``SLURM_NODEID`` is ``rollout-(ID+1)``): names
of the job's shape, not of the hosts Slurm placed it on, so that a requeued job that
lands on other hosts continues the journal's state. The engines listen on the host's
name, which their URLs carry. The plans reach them through the agents, as they reach the
elastic nodes': the same ``SplitServer`` (a node that is not the job's own goes to its
agent), the same weight reload before the router takes an engine, the same reports of
dead engines and agents. Unlike an elastic node's, their GPUs are the base job's from the
start and are never given back, and the run waits for their agents (up to
``slurm.join_timeout_s``) before its first decision: a plan made before would fail its
steps there, and ``decide()`` need not plan for them again.

A requeue of the job requeues both components: the agents stop with it and the next
incarnation's agents join the next run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pearl.cluster.agent_payload import AgentPayload
from pearl.coordinator.config import BaseNode
from pearl.io.documents import InputError
from pearl.run.config import RunConfig
from pearl.run.on_slurm import agent_section

NODE_PREFIX = "rollout-"


def rollout_base_nodes(config: RunConfig) -> tuple[BaseNode, ...]:
    """Component 1's nodes as the base job's rollout nodes (none without ``slurm.rollout``)."""
    r = config.slurm.rollout
    if r is None:
        return ()
    return tuple(
        BaseNode(name=f"{NODE_PREFIX}{i + 1}", gpu_type=r.gpu_type, num_gpus=r.gpus_per_node)
        for i in range(r.nodes)
    )


def check_heterogeneous(config: RunConfig, environ: Mapping[str, str] | None = None) -> None:
    """An ``InputError`` if the config asks for rollout nodes and the run's job has no
    second component of that many nodes."""
    r = config.slurm.rollout
    if r is None:
        return
    env = os.environ if environ is None else environ
    nodes = env.get("SLURM_JOB_NUM_NODES_HET_GROUP_1")
    if nodes is None:
        problem = (
            "the run's job has no second component (SLURM_JOB_NUM_NODES_HET_GROUP_1 is not "
            "set): submit it with `sbatch [run options] : [rollout options] "
            "slurm/pearl-run.sbatch CONFIG` (docs/slurm-run.md)"
        )
        raise InputError("<environment>", "slurm.rollout", problem)
    if nodes != str(r.nodes):
        problem = f"the job's second component has {nodes} nodes, not {r.nodes}"
        raise InputError("<environment>", "slurm.rollout.nodes", problem)


def rollout_agent(
    config: RunConfig, run_dir: Path, model: Path, environ: Mapping[str, str] | None = None
) -> AgentPayload:
    """The payload of one task of component 1: a node agent with the run's engines, as
    node ``rollout-(SLURM_NODEID+1)``."""
    r = config.slurm.rollout
    if r is None:
        raise InputError("<command line>", "--rollout-agent", "the config has no slurm.rollout")
    env = os.environ if environ is None else environ
    node_id = env.get("SLURM_NODEID")
    if node_id is None or not node_id.isdigit():
        problem = "not a task of the job's second component (SLURM_NODEID is not set)"
        raise InputError("<environment>", "--rollout-agent", problem)
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if len(visible) != r.gpus_per_node:
        problem = (
            f"this node has {len(visible)} GPUs in the job (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', '')!r}), not {r.gpus_per_node}: set the "
            "component's --gres to match"
        )
        raise InputError("<environment>", "slurm.rollout.gpus_per_node", problem)
    agents = agent_section(config, model)
    return AgentPayload(
        str(run_dir),
        r.gpu_type,
        agents.engine_commands(sys.executable),
        grace_s=agents.grace_s,
        reconnect_s=config.slurm.reconnect_s,
        engine_host=agents.engine_host,
        node=f"{NODE_PREFIX}{int(node_id) + 1}",
    )


async def wait_for_rollout_agents(config: RunConfig, control: Any, run_dir: Path) -> None:
    """Until an agent has joined on every rollout node (``control``: the run's
    ``SplitControl``), polled on the run's event loop (a signal stops the wait); an
    ``InputError`` naming the missing nodes after ``slurm.join_timeout_s``."""
    names = [n.name for n in rollout_base_nodes(config)]
    server = control.remote.server  # the MPI ControlServer the agents join
    end = time.monotonic() + config.slurm.join_timeout_s
    while missing := [n for n in names if server.agent_for_node(n) is None]:
        if time.monotonic() > end:
            problem = (
                f"no agent joined on {', '.join(missing)} within "
                f"{config.slurm.join_timeout_s:g} s (their logs: {run_dir / 'logs'}/agent-*.log)"
            )
            raise InputError("<environment>", "slurm.rollout", problem)
        await asyncio.sleep(0.2)
