"""``pearl run``'s configuration (YAML or JSON): the model, the environment and its reward,
the rollout's rules, the engines, the trainer. Every field has a default: the embedded
default (``RunConfig()``, what ``pearl run`` with no file runs) trains pearl's tiny Qwen3 on
``single_digit`` on a CPU machine. Unknown fields are refused, and every problem is one
line ``FILE: FIELD: PROBLEM`` (exit status 2). Paths are relative to the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pearl.agents.loop import Limits
from pearl.agents.manager import RolloutConfig
from pearl.core.config import PolicyConfig
from pearl.core.limits import (
    GroupSize,
    NonNegInt,
    PositiveSeconds,
    PositiveTokens,
    PositiveTrajectoryCount,
)
from pearl.core.profile import RuntimeProfile
from pearl.core.state import Frozen
from pearl.envs import registry
from pearl.io.documents import (
    InputError,
    load_profile,
    parse,
    read_document,
)
from pearl.io.policy_names import check_policy_names
from pearl.rollout.rules import Batching, PastBound, RolloutRules
from pearl.router.router import Sampling
from pearl.trainer.config import TrainerConfig
from pearl.trainer.megatron.config import MegatronOptions

PosInt = Annotated[int, Field(gt=0, le=1_000_000)]  # a count: a million at most
PosFloat = PositiveSeconds
Temperature = Annotated[float, Field(gt=0, le=100)]


class ModelSection(Frozen):
    dir: str | None = Field(
        None,
        description="A local Hugging Face model directory (Qwen3, Qwen2, Llama); None: "
        "pearl's tiny Qwen3, written to RUN_DIR/model by `pearl model init`'s defaults.",
    )
    seed: int = Field(0, description="The tiny model's initialisation seed (dir None).")


class RolloutSection(Frozen):
    group_size: GroupSize = Field(4, description="Samples per task (a GRPO group).")
    batch_trajectories: PositiveTrajectoryCount = Field(
        256, description="Trajectories per update (whole groups: a multiple of group_size)."
    )
    max_staleness_versions: NonNegInt = Field(
        1, description="A trajectory is trained at most this many versions after admission."
    )
    max_in_flight: PositiveTrajectoryCount | None = Field(
        None, description="Running trajectories at most (None: as the staleness bound allows)."
    )
    batching: Batching = Field(Batching.FIRST_COMPLETED, description="How a batch is formed.")
    past_bound: PastBound = Field(
        PastBound.INTERRUPT, description="What an update does to trajectories past the bound."
    )
    max_tokens: PositiveTokens = Field(16, description="Tokens a model turn may generate.")
    temperature: Annotated[float, Field(gt=0, le=100)] = Field(
        1.0, description="Sampling temperature."
    )
    max_turns: PosInt = Field(4, description="Model turns per trajectory at most.")
    max_context_tokens: PositiveTokens = Field(1024, description="Context of a trajectory at most.")
    step_timeout_s: PosFloat = Field(30.0, description="An environment step's time limit.")
    seed: int = Field(0, description="Tasks (environment seeds) and sampling seeds.")

    @model_validator(mode="after")
    def _whole_groups(self) -> RolloutSection:
        if self.batch_trajectories % self.group_size:
            raise ValueError(
                f"batch_trajectories: {self.batch_trajectories} is not a multiple of "
                f"group_size {self.group_size}"
            )
        return self

    def manager_config(self, snapshot_interval_s: float = 1.0) -> RolloutConfig:
        rules = RolloutRules(
            batch_trajectories=self.batch_trajectories,
            max_staleness_versions=self.max_staleness_versions,
            group_size=self.group_size,
            max_in_flight=self.max_in_flight,
            batching=self.batching,
            past_bound=self.past_bound,
        )
        return RolloutConfig(
            rules=rules,
            sampling=Sampling(
                max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed
            ),
            limits=Limits(
                max_turns=self.max_turns,
                max_context_tokens=self.max_context_tokens,
                step_timeout_s=self.step_timeout_s,
            ),
            seed=self.seed,
            snapshot_interval_s=snapshot_interval_s,
        )


class VllmEngineOptions(Frozen):
    """How ``vllm serve`` runs each engine (``engines.backend: vllm``): one GPU (slot) per
    engine, sleep mode on, NIXL for a disaggregated pair's KV, pearl's weight sync."""

    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="Share of each GPU's memory vLLM takes (None: vLLM's 0.9)."
    )
    max_model_len: PositiveTokens | None = Field(
        None, description="Longest prompt plus output in tokens (None: the model's)."
    )
    extra_args: tuple[str, ...] = Field(
        (), description="Arguments appended to `vllm serve` as given (e.g. --enforce-eager)."
    )


class EnginesSection(Frozen):
    backend: Literal["reference", "vllm"] = Field(
        "reference",
        description="pearl's CPU reference engine, or vLLM (`vllm serve` on each slot's GPU; "
        "needs the coordinator and a CUDA machine with vllm installed).",
    )
    vllm: VllmEngineOptions = Field(
        default_factory=VllmEngineOptions, description="vllm only: how `vllm serve` runs."
    )
    count: PosInt = Field(2, description="Engine instances.")
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="The PD configuration the run starts with (disaggregated: the first "
        "half of the instances prefill, the rest decode).",
    )
    threads: PosInt = Field(1, description="reference only: torch threads per engine.")
    max_num_seqs: PosInt = Field(64, description="Sequences an engine runs at once.")

    @model_validator(mode="after")
    def _pools(self) -> EnginesSection:
        if self.mode == "disaggregated" and self.count < 2:
            raise ValueError("count: disaggregated needs at least 2 engines")
        if self.backend != "vllm" and self.vllm != VllmEngineOptions():
            raise ValueError("vllm: options of backend 'vllm' only")
        return self


class TrainerSection(Frozen):
    backend: Literal["reference", "megatron"] = Field(
        "reference",
        description="The torch CPU trainer, or Megatron-core's (CUDA; its process only: "
        "`pearl trainer serve --backend megatron`).",
    )
    megatron: MegatronOptions = Field(
        default_factory=MegatronOptions, description="megatron only: how it builds the model."
    )
    steps: PosInt = Field(30, description="Updates the run trains.")
    process: bool = Field(
        True,
        description="The trainer in a process of its own (`pearl trainer serve`, driven over "
        "HTTP; restarted from its last checkpoint if it dies); false: in the run's process.",
    )
    optimizer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="The loss and the optimiser."
    )

    @model_validator(mode="after")
    def _megatron_in_its_process(self) -> TrainerSection:
        if self.backend == "megatron" and not self.process:
            raise ValueError("process: the megatron trainer runs in its own process (true)")
        if self.backend != "megatron" and self.megatron != MegatronOptions():
            raise ValueError("megatron: options of backend 'megatron' only")
        return self


DEFAULT_POLICY: dict[str, Any] = {  # pearl's policy at this run's time scale (seconds)
    "elastic": {"rule": "never", "gpu_type": "cpu"},
    "borrowing": {"min_gain_s": 0.2, "return_margin_s": 0.2, "max_return_delay_s": 5.0},
    "switching": {"min_gain_s": 0.4, "min_dwell_s": 10.0},
}


class CoordinatorSection(Frozen):
    enabled: bool = Field(
        True,
        description="The coordinator's decide() places the engines, lends the trainer's "
        "slots between updates and reconfigures PD (false: the engines section, fixed).",
    )
    profile: str = Field("tiny-cpu", description="The runtime profile decide() predicts with.")
    trainer_slots: PosInt = Field(1, description="The base trainer's devices (slots).")
    rollout_slots: PosInt = Field(2, description="The base rollout's devices (slots).")
    decision_interval_s: PosFloat = Field(1.0, description="Seconds between decisions.")
    asleep_engines: bool = Field(
        True,
        description="An engine started on every trainer slot and put to sleep before the "
        "first decision (as vLLM's sleep mode lets one share a trainer's GPU): lending the "
        "slot wakes it instead of cold-starting one.",
    )
    elastic_slots: NonNegInt = Field(
        0,
        description="Elastic slots at most (LocalBackend, on the shipped availability "
        "windows); 0: none. The policy's elastic rule decides whether to ask.",
    )
    elastic_time_scale: Annotated[float, Field(gt=0, le=1e6)] = Field(
        1000.0, description="Trace seconds per run second of the availability windows."
    )
    elastic_offset_s: float = Field(5.0, description="Run time of the windows' start.")
    policy_name: Literal["pearl", "roll-fixed", "roll-partial", "static-pd-disaggregated"] = Field(
        "pearl",
        description="pearl, or a baseline of docs/baselines.md (pearl.sim.baselines) "
        "over the same policy section; the adaptive rlboost-plus is the simulator's only.",
    )
    policy: dict[str, Any] = Field(
        default_factory=dict,
        description="pearl.core.config.PolicyConfig, as a mapping, over DEFAULT_POLICY "
        "(docs/architecture.md).",
    )

    @model_validator(mode="after")
    def _policy(self) -> CoordinatorSection:
        self.policy_config()  # a bad policy is the config's error
        return self

    def policy_config(self) -> PolicyConfig:
        """The policy decide() runs: ``policy``, as ``policy_name`` makes it (a baseline
        fixes its rules: ``pearl.sim.baselines.make_policy``)."""
        from pearl.sim.baselines import make_policy

        merged = _merged(DEFAULT_POLICY, self.policy)
        return make_policy(self.policy_name, PolicyConfig.model_validate(merged), 1).config()


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``, mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class SlurmJob(Frozen):
    """The run's own job (``pearl run --cluster slurm --submit``, ``slurm/pearl-run.sbatch``):
    it holds the trainer's and the base rollout's devices and runs the data plane."""

    partition: str = Field("train", min_length=1, description="Partition of the run's job.")
    gres: str | None = Field(
        None,
        description="The job's GPUs as Slurm gres (gpu:h800:4: the trainer's slots first, "
        "then the base rollout's); None: no gres (a CPU machine's slots).",
        pattern=r"^[A-Za-z0-9_:.-]+$",
    )
    cpus_per_task: PosInt = Field(2, description="CPUs of the run's job.")
    time_limit_min: PosInt = Field(1440, description="Time limit of one incarnation.")
    signal_delay_s: PosInt = Field(
        120,
        description="Slurm's warning (USR2) this long before the time limit: the run "
        "stops cleanly, keeping its elastic jobs, and is requeued.",
    )
    max_requeues: NonNegInt = Field(100, description="Incarnations after the first at most.")


class RolloutNodes(Frozen):
    """The base rollout's own nodes: the second component of the run's heterogeneous job
    (``sbatch ... : ... slurm/pearl-run.sbatch``; submitit cannot submit one; its
    partition, CPUs and time are sbatch's options), a node agent on each serving the run's
    engines (``pearl.run.rollout_nodes``)."""

    nodes: PosInt = Field(1, description="Its nodes (checked against the job's).")
    gpu_type: str = Field("h800", min_length=1, description="Their GPU type (gres type).")
    gpus_per_node: PosInt = Field(
        4, description="The GPUs of each node the job holds (checked against its gres)."
    )


class SlurmSection(Frozen):
    """Elastic allocations on Slurm (``cluster: slurm``): the policy's elastic section
    names the partition, the GPU type, the GPUs per allocation and the time limit; this
    one what the cluster offers and how the allocations' node agents run."""

    run_id: str | None = Field(
        None,
        description="Tags the run's Slurm jobs (pearl-RUN_ID-el0001); None: the run "
        "directory's name and a hash of its path.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        max_length=64,
    )
    gpus_per_node: dict[str, PosInt] = Field(
        default_factory=lambda: {"h20": 2},
        description="GPUs per node of each elastic GPU type on this cluster.",
    )
    profile_gpu_types: dict[str, str] = Field(
        default_factory=dict,
        description="A cluster GPU type and the profile's GPU type whose costs stand for it "
        "(the dev cluster's GPUs are device files and its engines run on the CPU: "
        "{h20: cpu}); a type not named here must be the profile's own.",
    )
    qos: str | None = Field(None, description="Slurm QOS of the elastic jobs.")
    poll_interval_s: PosFloat = Field(2.0, description="Fewest seconds between Slurm queries.")
    grace_s: PosFloat = Field(
        30.0, description="Time an elastic node's agent has to drain when it is taken back."
    )
    join_timeout_s: PosFloat = Field(
        300.0, description="A grant whose agents have not joined by then is given back."
    )
    reconnect_s: PosFloat = Field(
        600.0,
        le=30 * 86400.0,
        description="How long an elastic job holds its allocation for the run's next "
        "incarnation once the run has stopped (a requeue, Slurm's warning, scancel): then "
        "its agent ends and the allocation with it.",
    )
    job: SlurmJob = Field(default_factory=SlurmJob)
    rollout: RolloutNodes | None = Field(
        None,
        description="Base rollout nodes of their own, the run's job's second component "
        "(None: the base rollout is the job's own slots only).",
    )


class RunConfig(Frozen):
    schema_version: Literal[1] = Field(1, description="Configuration schema version.")
    run_dir: str = Field("runs/pearl-run", description="Where the run's files go.")
    model: ModelSection = Field(default_factory=ModelSection)
    env: dict[str, Any] = Field(
        default_factory=lambda: {"name": "single_digit", "operators": "+", "max_turns": 3},
        description="The environment and its reward (docs/envs.md: `name` and its knobs).",
    )
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    engines: EnginesSection = Field(default_factory=EnginesSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    coordinator: CoordinatorSection = Field(default_factory=CoordinatorSection)
    cluster: Literal["local", "slurm"] = Field(
        "local",
        description="Where elastic devices come from: this machine's slots on the shipped "
        "windows (coordinator.elastic_slots), or Slurm jobs with node agents (the slurm "
        "section; the run itself runs in a Slurm job: docs/slurm-run.md).",
    )
    slurm: SlurmSection = Field(default_factory=SlurmSection)

    @model_validator(mode="after")
    def _slurm_needs_the_coordinator(self) -> RunConfig:
        if self.cluster == "slurm" and not self.coordinator.enabled:
            raise ValueError("cluster: slurm needs coordinator.enabled (decide() asks Slurm)")
        if self.engines.backend == "vllm" and not self.coordinator.enabled:
            raise ValueError("engines.backend: vllm needs coordinator.enabled (plans start them)")
        return self


def load_run_config(path: str | Path | None) -> tuple[RunConfig, Path]:
    """The validated configuration (the embedded default without a file) and the folder
    its relative paths start from."""
    if path is None:
        return RunConfig(), Path.cwd()
    p = Path(path)
    config = parse(RunConfig, read_document(p), p)
    registry.config_of(config.env, p)  # the environment's own checks, naming env.FIELD
    check_policy_names(config.coordinator.policy_config(), p, "coordinator.policy")
    if config.cluster == "slurm":
        cluster_profile(config, p.parent, p)  # GPU types the profile cannot cost, named here
    return config, p.parent


def cluster_profile(
    config: RunConfig, relative_to: Path, named_in: Path | None = None
) -> RuntimeProfile:
    """The profile decide() predicts with on the cluster: ``coordinator.profile`` with each
    cluster GPU type of ``slurm.profile_gpu_types`` costed as the profile type it names;
    the elastic GPU type must be costed one way or the other."""
    profile = load_profile(config.coordinator.profile, relative_to=relative_to, named_in=named_in)
    where = named_in or "<config>"
    gpus = dict(profile.gpus)
    for cluster_type, profile_type in config.slurm.profile_gpu_types.items():
        if profile_type not in profile.gpus:
            known = ", ".join(sorted(profile.gpus))
            problem = f"the profile has no GPU type {profile_type!r} (it has {known})"
            raise InputError(where, f"slurm.profile_gpu_types.{cluster_type}", problem)
        gpus[cluster_type] = profile.gpus[profile_type]
    elastic = config.coordinator.policy_config().elastic
    if elastic.rule != "never" and elastic.gpu_type not in gpus:
        problem = (
            f"{elastic.gpu_type!r} has no costs in profile {config.coordinator.profile!r}: "
            "name the profile's type that stands for it in slurm.profile_gpu_types"
        )
        raise InputError(where, "coordinator.policy.elastic.gpu_type", problem)
    rollout = config.slurm.rollout
    if rollout is not None and rollout.gpu_type not in gpus:
        problem = (
            f"{rollout.gpu_type!r} has no costs in profile {config.coordinator.profile!r}: "
            "name the profile's type that stands for it in slurm.profile_gpu_types"
        )
        raise InputError(where, "slurm.rollout.gpu_type", problem)
    if elastic.rule != "never" and elastic.gpu_type not in config.slurm.gpus_per_node:
        known = ", ".join(sorted(config.slurm.gpus_per_node))
        problem = f"{elastic.gpu_type!r} is not in slurm.gpus_per_node ({known})"
        raise InputError(where, "coordinator.policy.elastic.gpu_type", problem)
    return profile.model_copy(update={"gpus": gpus})
