"""The coordinator's configuration document (YAML or JSON), validated with one-line errors.

It names the run, where its files live, the runtime profile, the allocation backend and
what the cluster offers, the base job's nodes, pearl's policy, and the node agents with the
engine they start (``agents.engines`` as commands, or ``agents.engine``: a backend and a
model, :mod:`pearl.engines.backend`). Paths are relative to the configuration file.
Unknown fields are rejected; every problem is ``FILE: FIELD: PROBLEM``
(``pearl.io.documents.InputError``), exit status 2 on the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pearl.core import base_job
from pearl.core.config import PolicyConfig
from pearl.core.limits import MAX_GPUS_PER_NODE, PositiveSeconds
from pearl.core.state import (
    ClusterState,
    Frozen,
)
from pearl.engines.backend import EngineSection, engine_commands
from pearl.io.documents import InputError, load_profile, parse, read_document
from pearl.io.policy_names import check_policy_names

RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64)]
PosInt = Annotated[int, Field(gt=0, le=MAX_GPUS_PER_NODE)]  # GPUs of a node
PosFloat = PositiveSeconds


class BaseNode(Frozen):
    name: Annotated[str, Field(min_length=1)] = Field(description="Slurm node name.")
    gpu_type: Annotated[str, Field(min_length=1)] = Field(description="GPU type (gres type).")
    num_gpus: PosInt = Field(description="GPUs of the node in the base job.")


class BaseJob(Frozen):
    trainer: tuple[BaseNode, ...] = Field(min_length=1, description="Nodes that train.")
    rollout: tuple[BaseNode, ...] = Field((), description="Nodes that serve rollout.")
    asleep_engines: bool = Field(
        False,
        description="Every trainer GPU hosts an asleep engine from the start (started and "
        "put to sleep by whoever runs the base job), so that lending it wakes an engine "
        "rather than cold-starting one.",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> BaseJob:
        seen: set[str] = set()
        for field, nodes in (("trainer", self.trainer), ("rollout", self.rollout)):
            for i, node in enumerate(nodes):
                if node.name in seen:
                    raise ValueError(f"{field}[{i}].name: node {node.name!r} is listed twice")
                seen.add(node.name)
        return self


class AgentSection(Frozen):
    engines: tuple[str, ...] = Field(
        (),
        description="Engine command per role, ROLE=CMD ({port}, {kv_port}, {role}, "
        "{worker_id}; literal braces doubled). Exclusive with engine.",
    )
    engine: EngineSection | None = Field(
        None,
        description="The engine every worker starts (backend reference or vllm, the model "
        "directory, ...), rendered into the agents' commands. Exclusive with engines.",
    )
    null_workers: bool = Field(False, description="Record commands without engines.")
    router_url: str | None = Field(
        None,
        description="The router's front (http://HOST:PORT), told of every plan step so that "
        "its instance table follows the plan (docs/router.md, 'Plan steps'); None: no router.",
        pattern=r"^https?://[^\s/]+(/.*)?$",
    )
    engine_host: Literal["loopback", "node"] = Field(
        "loopback",
        description="Where the agents' engines listen and what their URLs name: loopback "
        "(a router on the same machine), or the node's name (a router on another node).",
    )
    grace_s: PosFloat = Field(30.0, description="Time an agent has to drain on preemption.")
    join_timeout_s: PosFloat = Field(
        300.0, description="A granted allocation whose agents have not joined by then is released."
    )

    @model_validator(mode="after")
    def _one_way_to_name_engines(self) -> AgentSection:
        if self.engines and self.engine is not None:
            raise ValueError("engines and engine are exclusive: give the commands or the engine")
        return self

    def engine_commands(self, python: str) -> tuple[str, ...]:
        """The agents' ``--engine ROLE=CMD`` values: ``engines`` as given, or ``engine``
        rendered (:func:`pearl.engines.backend.engine_commands`, run by ``python``)."""
        if self.engine is None:
            return self.engines
        return tuple(f"{r}={c}" for r, c in engine_commands(self.engine, python).items())


class CoordinatorConfig(Frozen):
    schema_version: Literal[1] = Field(description="Configuration schema version.")
    run_id: RunId = Field(description="Tags every job and file of the run.")
    run_dir: str = Field(description="Journal, logs and the MPI port file (shared FS).")
    profile: Annotated[str, Field(min_length=1)] = Field(description="Runtime profile.")
    backend: Literal["slurm", "local"] = Field(description="Where elastic jobs run.")
    gpus_per_node: dict[str, PosInt] = Field(
        min_length=1, description="GPUs per node of each elastic GPU type on this cluster."
    )
    qos: str | None = Field(None, description="Slurm QOS of elastic jobs (None: none).")
    poll_interval_s: PosFloat = Field(5.0, description="Fewest seconds between Slurm queries.")
    decision_interval_s: PosFloat = Field(10.0, description="Seconds between decisions.")
    journal_max_bytes: Annotated[int, Field(gt=0, le=2**40)] = Field(
        64 << 20, description="Size past which the journal is compacted (last state kept)."
    )
    base: BaseJob = Field(description="The base job's nodes.")
    policy: PolicyConfig = Field(PolicyConfig(), description="pearl's decision policy.")
    agents: AgentSection | None = Field(
        None, description="Node agents in the allocations (None: allocations only hold nodes)."
    )

    @model_validator(mode="after")
    def _elastic_type_offered(self) -> CoordinatorConfig:
        wanted = self.policy.elastic.gpu_type
        if self.policy.elastic.rule != "never" and wanted not in self.gpus_per_node:
            known = ", ".join(sorted(self.gpus_per_node))
            raise ValueError(
                f"policy.elastic.gpu_type: {wanted!r} is not in gpus_per_node ({known})"
            )
        return self


def load_config(path: str | Path) -> tuple[CoordinatorConfig, Path]:
    """The validated configuration and its run directory (made absolute)."""
    p = Path(path)
    config = parse(CoordinatorConfig, read_document(p), p)
    check_policy_names(config.policy, p, "policy")
    profile = load_profile(config.profile, relative_to=p.parent, named_in=p)  # fail early
    known = ", ".join(sorted(profile.gpus))
    for gpu_type in sorted(config.gpus_per_node):
        if gpu_type not in profile.gpus:
            problem = f"GPU type {gpu_type!r} is not in profile {config.profile} ({known})"
            raise InputError(p, f"gpus_per_node.{gpu_type}", problem)
    return _engine_model_resolved(config, p.parent), (p.parent / config.run_dir).resolve()


def _engine_model_resolved(config: CoordinatorConfig, folder: Path) -> CoordinatorConfig:
    """``config`` with ``agents.engine.model`` made absolute (relative to ``folder``)."""
    a = config.agents
    if a is None or a.engine is None or Path(a.engine.model).is_absolute():
        return config
    engine = a.engine.model_copy(update={"model": str((folder / a.engine.model).resolve())})
    return config.model_copy(update={"agents": a.model_copy(update={"engine": engine})})


def initial_state(config: CoordinatorConfig) -> ClusterState:
    """The base job as the core sees it: one trainer per trainer node (its GPUs), the
    rollout nodes' GPUs free for the first decision to place engines on (with
    ``base.asleep_engines``, an asleep engine on every trainer GPU too)."""
    return base_job.base_job_state(
        [base_job.BaseNode(n.name, n.gpu_type, n.num_gpus) for n in config.base.trainer],
        [base_job.BaseNode(n.name, n.gpu_type, n.num_gpus) for n in config.base.rollout],
        asleep_engines=config.base.asleep_engines,
    )
