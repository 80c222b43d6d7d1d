"""A simulation scenario: the base job, the elastic GPUs, the rollout and training setup and
the pearl policy's configuration, as one typed, validated document (pure).

Rules checked here (the message names the field; the shell adds the file name):
- every count, time and rate has its sign (``nodes >= 0``, ``batch_trajectories >= 1``,
  ``staleness_versions >= 0``, times ``> 0`` or ``>= 0`` as documented per field);
- the trainer has at least one node; the base rollout has GPUs unless elastic GPUs exist
  (``elastic.source`` is ``trace`` or ``synthetic``);
- ``elastic.trace`` is given exactly when ``source`` is ``trace``, ``elastic.synthetic``
  exactly when it is ``synthetic``; elastic allocations are whole 8-GPU nodes;
- the pearl policy requests the GPU type the elastic source grants;
- scaled prompt tokens fit in the model's context (``rollout.max_context_tokens``);
- at most one data file per input: ``elastic.trace.windows_file`` or ``idle_series_file``,
  ``rollout.workload_file`` or ``traces_dir`` (none = pearl's shipped data).

GPU types are checked against the runtime profile by the loader (``pearl.io.scenarios``),
which has the profile; this module knows no profile. Data paths are strings here; the
loader expands and resolves them and checks that they exist.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pearl.core.config import PolicyConfig
from pearl.core.limits import (
    MAX_GPUS_PER_NODE,
    MAX_SEEDS,
    GroupSize,
    Id,
    NodeCount,
    NonNegFloat,
    NonNegInt,
    PositiveGpuCount,
    PositiveSeconds,
    PositiveTokens,
    PositiveTrajectoryCount,
    Seconds,
    Turns,
)
from pearl.core.limits import PositiveFloat as PosFloat
from pearl.core.state import Frozen
from pearl.rollout.rules import Batching, PastBound, RolloutRules
from pearl.sim.availability import GPUS_PER_NODE
from pearl.sim.engine_models import EngineModelName

PosInt = Annotated[int, Field(ge=1, le=1_000_000)]
GpuType = Id
# A file or folder; the loader expands $VARIABLES and ~ and resolves it against the scenario.
DataPath = Annotated[str, Field(min_length=1)]


def _at_most_one(section: Frozen, first: str, second: str) -> None:
    """Two fields that name the same input in two ways: at most one may be given."""
    if getattr(section, first) is not None and getattr(section, second) is not None:
        raise ValueError(f"{second}: given with {first} (name one of them)")


class NodeGroup(Frozen):
    nodes: NodeCount = Field(description="Number of nodes.")
    gpus_per_node: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)] = Field(
        GPUS_PER_NODE, description="GPUs on each node."
    )
    gpu_type: GpuType = Field(description="GPU type as named in the runtime profile.")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class ClusterSection(Frozen):
    trainer: NodeGroup = Field(description="Trainer nodes of the base job (lendable GPUs).")
    rollout: NodeGroup = Field(description="Base rollout nodes of the base job.")


class TraceElastic(Frozen):
    gpu_type: GpuType = Field(description="GPU type the trace's windows are granted as.")
    min_duration_s: Seconds = Field(
        600.0, description="Windows shorter than this are dropped (availability rule 4)."
    )
    offset_s: Seconds = Field(
        0.0, description="Trace time that maps to simulated time 0 (the run's start)."
    )
    max_gpus: PositiveGpuCount | None = Field(
        None, description="Cap on elastic GPUs open at once; None = no cap."
    )
    windows_file: DataPath | None = Field(
        None,
        description="An availability windows file (format pearl.availability_windows); "
        "None = the shipped pearl/data/helios_windows.json.",
    )
    idle_series_file: DataPath | None = Field(
        None,
        description="A raw Helios cluster_sequence CSV (time, idle_gpu_num per minute) to "
        "cut into windows instead of a windows file (research use).",
    )

    @model_validator(mode="after")
    def _one_file(self) -> TraceElastic:
        _at_most_one(self, "windows_file", "idle_series_file")
        return self


class SyntheticElastic(Frozen):
    gpu_type: GpuType = Field(description="GPU type of the synthetic windows.")
    arrivals_per_h: PosFloat = Field(description="Poisson arrival rate of windows, per hour.")
    lifetime_median_s: PositiveSeconds = Field(
        description="Median of the lognormal window lifetime."
    )
    lifetime_sigma: NonNegFloat = Field(description="Log-space sigma of the window lifetime.")
    gpus_per_allocation: PositiveGpuCount = Field(
        GPUS_PER_NODE, description="GPUs of each window (whole nodes)."
    )
    max_gpus: PositiveGpuCount | None = Field(
        None, description="Arrivals that would open more GPUs than this are dropped."
    )

    @property
    def lifetime_mean_s(self) -> float:
        """Mean lifetime, as ``synthetic_windows`` takes it: median x exp(sigma^2 / 2)."""
        return self.lifetime_median_s * math.exp(self.lifetime_sigma**2 / 2.0)


class ElasticSection(Frozen):
    source: Literal["trace", "synthetic", "none"] = Field(
        description="Where elastic availability comes from."
    )
    trace: TraceElastic | None = Field(None, description="Settings when source is trace.")
    synthetic: SyntheticElastic | None = Field(
        None, description="Settings when source is synthetic."
    )
    queue_delay_median_s: Seconds = Field(
        30.0, description="Median of the lognormal Slurm queueing delay before a grant."
    )
    queue_delay_sigma: NonNegFloat = Field(
        0.0, description="Log-space sigma of the Slurm queueing delay."
    )
    grace_s: Seconds = Field(
        0.0, description="Preemption grace period: notice before the owner reclaims GPUs."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ElasticSection:
        for name in ("trace", "synthetic"):
            given = getattr(self, name) is not None
            if given and self.source != name:
                raise ValueError(f"{name}: given but source is {self.source!r}")
            if not given and self.source == name:
                raise ValueError(f"{name}: required when source is {name!r}")
        syn = self.synthetic
        if syn is not None and syn.gpus_per_allocation % GPUS_PER_NODE:
            raise ValueError(
                f"synthetic.gpus_per_allocation: {syn.gpus_per_allocation} is not a "
                f"multiple of {GPUS_PER_NODE} (windows are whole nodes)"
            )
        return self

    @property
    def gpu_type(self) -> str | None:
        """GPU type the elastic source grants; None without elastic GPUs."""
        section = self.trace or self.synthetic
        return section.gpu_type if section is not None else None


class WorkloadScaling(Frozen):
    """Means passed to ``pearl.sim.trajectories.scaled``; None keeps the data's mean."""

    prompt_tokens: PosFloat | None = Field(None, description="Mean prompt tokens.")
    output_tokens_per_turn: PosFloat | None = Field(
        None, description="Mean output tokens per turn."
    )
    observation_tokens_per_turn: PosFloat | None = Field(
        None, description="Mean tokens the environment appends per turn."
    )
    env_latency_s: Seconds | None = Field(
        None, description="Mean environment (tool) latency per turn."
    )
    turns_per_trajectory: Annotated[Turns, Field(ge=1.0)] | None = Field(
        None, description="Mean turns per trajectory."
    )

    def kwargs(self) -> dict[str, float | None]:
        """Keyword arguments for ``scaled(model, **kwargs)``."""
        return self.model_dump()


class RolloutSection(Frozen):
    batch_trajectories: PositiveTrajectoryCount = Field(
        description="B: trajectories the trainer consumes per training step."
    )
    staleness_versions: NonNegInt = Field(
        description="η: a trajectory is consumed at most η policy versions after the one it "
        "was admitted (or re-based) under (AReaL max_head_offpolicyness)."
    )
    group_size: GroupSize = Field(
        1, description="Samples per prompt (a GRPO group); batch_trajectories is a multiple."
    )
    max_in_flight: PositiveTrajectoryCount | None = Field(
        None, description="Running trajectories at most (AReaL max_concurrent_rollouts)."
    )
    batching: Batching = Field(
        Batching.FIRST_COMPLETED,
        description="first-completed: the first complete groups make the batch (AReaL, "
        "slime); in-order: batch b is trajectories b*B..(b+1)*B-1, all of them.",
    )
    past_bound: PastBound = Field(
        PastBound.INTERRUPT,
        description="A trajectory an update puts past the bound: interrupt (continue under "
        "the new weights with its partial output), restart (from its prompt) or drop.",
    )
    initial_policy_version: NonNegInt = Field(
        0, description="Policy version of the weights the run starts from."
    )
    workload: WorkloadScaling = Field(
        WorkloadScaling(), description="Workload means; None = from the traces."
    )
    max_context_tokens: PositiveTokens = Field(
        description="The model's context length; prompts are clipped to it."
    )
    workload_file: DataPath | None = Field(
        None,
        description="A workload samples file (format pearl.workload_samples); None = the "
        "shipped pearl/data/agentic_workload.json.",
    )
    traces_dir: DataPath | None = Field(
        None,
        description="A folder of the raw public traces to fit the workload to instead of a "
        "samples file (research use, e.g. $PEARL_TRACES).",
    )

    @model_validator(mode="after")
    def _one_source_and_rules(self) -> RolloutSection:
        _at_most_one(self, "workload_file", "traces_dir")
        self.rules()  # RolloutRules checks the groups against the batch and the cap
        return self

    def rules(self) -> RolloutRules:
        return RolloutRules(
            batch_trajectories=self.batch_trajectories,
            max_staleness_versions=self.staleness_versions,
            group_size=self.group_size,
            max_in_flight=self.max_in_flight,
            batching=self.batching,
            past_bound=self.past_bound,
            initial_version=self.initial_policy_version,
        )


class TrainingSection(Frozen):
    train_step_s: PositiveSeconds | None = Field(
        None, description="Time of one update; None = the profile's costs.train_step_s."
    )
    weight_sync_every_update: bool = Field(
        True, description="Sync weights to every inference instance after each update."
    )


class Scenario(Frozen):
    schema_version: Literal[1] = Field(description="Scenario schema version.")
    name: Annotated[str, Field(min_length=1)] = Field(description="Scenario name.")
    profile: Annotated[str, Field(min_length=1)] = Field(
        description="Runtime profile: a shipped name (qwen3-8b) or a YAML path."
    )
    duration_s: PositiveSeconds = Field(description="Simulated time of one run.")
    seeds: Annotated[int, Field(ge=1, le=MAX_SEEDS)] = Field(
        3, description="Default number of seeds (runs) per policy."
    )
    cluster: ClusterSection = Field(description="The base job.")
    elastic: ElasticSection = Field(description="External (elastic) GPUs.")
    rollout: RolloutSection = Field(description="Rollout batch, staleness and workload.")
    training: TrainingSection = Field(TrainingSection(), description="Trainer settings.")
    policy: PolicyConfig = Field(PolicyConfig(), description="Configuration of pearl.")
    engine_model: EngineModelName = Field(
        "step",
        description="How the inference instances are simulated: step (vLLM's scheduler step "
        "by step, the reference) or fluid (to the next change of the batch in one call: "
        "faster, throughput within 2% on the shipped scenarios; docs/simulator.md).",
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> Scenario:
        if self.cluster.trainer.nodes < 1:
            raise ValueError("cluster.trainer.nodes: must be >= 1 (the trainer needs GPUs)")
        if self.cluster.rollout.gpus == 0 and self.elastic.source == "none":
            raise ValueError(
                "cluster.rollout.nodes: must be > 0 unless elastic.source is trace or synthetic"
            )
        granted = self.elastic.gpu_type
        wanted = self.policy.elastic.gpu_type
        if granted is not None and wanted != granted:
            raise ValueError(
                f"policy.elastic.gpu_type: {wanted!r} differs from elastic.{self.elastic.source}"
                f".gpu_type {granted!r} (pearl would request GPUs that are never granted)"
            )
        prompt = self.rollout.workload.prompt_tokens
        if prompt is not None and prompt >= self.rollout.max_context_tokens:
            raise ValueError(
                f"rollout.workload.prompt_tokens: {prompt:g} does not fit in "
                f"rollout.max_context_tokens {self.rollout.max_context_tokens}"
            )
        return self

    def gpu_types(self) -> list[tuple[str, str]]:
        """(field, GPU type) of every GPU type the scenario names, for the loader's check."""
        out = [
            ("cluster.trainer.gpu_type", self.cluster.trainer.gpu_type),
            ("cluster.rollout.gpu_type", self.cluster.rollout.gpu_type),
        ]
        if self.elastic.gpu_type is not None:
            out.append((f"elastic.{self.elastic.source}.gpu_type", self.elastic.gpu_type))
        return out

    @property
    def base_gpus(self) -> int:
        return self.cluster.trainer.gpus + self.cluster.rollout.gpus
