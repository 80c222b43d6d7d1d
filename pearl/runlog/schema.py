"""The run log: one JSON object per line, one schema for simulated and real runs.

Every record carries ``v`` (the schema version), ``t`` (the run's clock, seconds since
its start) and ``type``; the other fields depend on the type (``docs/log-schema.md``
lists them). The simulator and the coordinator write the same records, so one analysis
reads both. Pure: no I/O; ``pearl.runlog.jsonl`` writes and reads files.

Invariants: a record round-trips through ``encode``/``decode`` unchanged; ``decode``
rejects an unknown type, a missing field or a wrong version with a ``ValueError`` naming
the field, so a reader can skip and count bad lines instead of crashing. Optional fields
added to a record type after it was first written (``_OMIT_UNSET``) are left out of its
line while they hold their default, so a writer that does not set them writes the same
lines as before they existed.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, TypeAdapter, ValidationError

from pearl.core.limits import NonNegFloat, NonNegInt, Seconds
from pearl.core.state import Frozen

SCHEMA_VERSION = 1


class _Record(Frozen):
    # optional fields added later: not written while at their default (see the docstring)
    _OMIT_UNSET: ClassVar[tuple[str, ...]] = ()

    v: Literal[1] = 1  # SCHEMA_VERSION
    t: Seconds = Field(description="Run clock (s since the run started).")


class RunStarted(_Record):
    type: Literal["run_started"] = "run_started"
    run_id: str
    source: Literal["simulator", "coordinator", "rollout"]  # rollout: the rollout manager
    policy: str
    scenario: str = ""
    seed: int | None = None
    profile: str = ""
    max_return_delay_s: float | None = Field(
        None, description="The policy's limit on the trainer's wait for its GPUs."
    )


class GpuAdded(_Record):
    type: Literal["gpu_added"] = "gpu_added"
    gpu_id: str
    node: str
    gpu_type: str
    source: Literal["base-train", "base-rollout", "elastic"]
    allocation_id: str


class GpuRemoved(_Record):
    type: Literal["gpu_removed"] = "gpu_removed"
    gpu_id: str
    reason: str = ""


class WorkerPhase(_Record):
    """A worker entered a phase (and, on entry into switching, a role)."""

    type: Literal["worker_phase"] = "worker_phase"
    worker_id: str
    kind: Literal["engine", "trainer"]
    gpu_ids: tuple[str, ...]
    role: Literal["train", "colocated", "prefill", "decode", "idle"]
    phase: Literal["starting", "ready", "draining", "switching", "stopping", "gone"]


class DecisionMade(_Record):
    type: Literal["decision"] = "decision"
    policy: str
    pd_mode: Literal["colocated", "disaggregated", "none"]
    target: str = Field(description="Label of the target configuration.")
    switch: bool
    mandatory: bool
    predicted_current_s: float | None = Field(description="null when infinite.")
    predicted_target_s: float | None
    transition_s: float
    num_steps: int
    borrow: str
    num_elastic_requests: int
    reasons: tuple[str, ...]
    decide_s: float | None = Field(
        default=None,
        description="Wall seconds of the decide() calls this record covers: this one and "
        "those not logged since the previous record; null where not measured (the simulator).",
    )
    decide_calls: int = Field(default=1, ge=1, description="The decide() calls it covers.")


class PlanStepDone(_Record):
    type: Literal["plan_step"] = "plan_step"
    action: str
    worker_id: str
    started_t: Seconds
    ok: bool = True
    error: str = ""


class AllocationChanged(_Record):
    type: Literal["allocation"] = "allocation"
    allocation_id: str
    status: Literal["requested", "pending", "granted", "preempting", "ended", "released"]
    gpu_type: str = ""
    num_gpus: int = 0
    reason: str = ""


class BorrowChanged(_Record):
    type: Literal["borrow"] = "borrow"
    kind: Literal["lend", "return", "force_return", "returned"]
    gpu_ids: tuple[str, ...]
    return_by_t: Seconds | None = None


class TrajectoryFinished(_Record):
    type: Literal["trajectory_finished"] = "trajectory_finished"
    traj_id: str
    batch_id: int | None = Field(
        None,
        description="In-order batches: its batch; first-completed: None (a batch is the "
        "first complete groups, known when it is taken: batch_consumed).",
    )
    num_turns: int
    output_tokens: int
    min_policy_version: int = Field(description="Oldest policy version among its tokens.")
    # Written by the rollout manager (the simulator leaves them at their defaults):
    reward: float | None = None
    end_reason: str = Field(
        "",
        description="Why the episode ended: the env's reason, max_turns, context_limit, "
        "turn_failed, ...; empty when not logged.",
    )
    prompt_tokens: NonNegInt | None = Field(None, description="Of its first turn.")
    observation_tokens: NonNegInt | None = Field(
        None, description="Appended by its tool steps (env observations)."
    )
    started_t: Seconds | None = Field(None, description="Its admission.")

    _OMIT_UNSET = ("reward", "end_reason", "prompt_tokens", "observation_tokens", "started_t")


class TurnEnded(_Record):
    """A model turn of a trajectory ended (written by the rollout manager; ``t``: its end)."""

    type: Literal["turn_ended"] = "turn_ended"
    traj_id: str
    turn: NonNegInt = Field(description="0-based.")
    prompt_tokens: NonNegInt
    output_tokens: NonNegInt
    started_t: Seconds = Field(description="The turn's send.")
    env_s: NonNegFloat | None = Field(description="The tool step after it; None after the last.")
    served_by: tuple[str, ...] = Field(
        description="Engine instances that generated its tokens, in order (several: migrated)."
    )
    prefilled_by: tuple[str, ...] = Field(
        description="Disaggregated prefill instances; () when colocated."
    )
    continuations: NonNegInt = Field(description="Requests resubmitted after an abort.")
    finish_reason: str | None


class TrajectoryLost(_Record):
    """A trajectory in flight was lost; it is started again from its prompt."""

    type: Literal["trajectory_lost"] = "trajectory_lost"
    traj_id: str
    reason: str = Field(description="e.g. manager_restart: in flight when the manager died.")
    wasted_tokens: NonNegInt = Field(description="Output tokens generated for it, lost.")
    turns_done: NonNegInt


class BatchCompleted(_Record):
    """The trainer's next batch became complete (it may start its update)."""

    type: Literal["batch_completed"] = "batch_completed"
    batch_id: int
    started_t: Seconds = Field(
        description="In-order: its first trajectory's start; first-completed: when the "
        "previous batch was taken."
    )
    predicted_s: float | None = Field(description="Predicted at the batch's first decision.")


class BatchConsumed(_Record):
    """The trainer took a batch for an update."""

    type: Literal["batch_consumed"] = "batch_consumed"
    batch_id: int
    policy_version: int = Field(description="The weights the update trains.")
    trajectories: int
    output_tokens: int
    off_policy_tokens: int = Field(description="Generated by an older version than these.")
    max_staleness_versions: int = Field(description="policy_version less the oldest head.")
    mean_staleness_versions: NonNegFloat


class PastBoundApplied(_Record):
    """An update put trajectories past the staleness bound; what became of them."""

    type: Literal["past_bound"] = "past_bound"
    policy_version: int = Field(description="The weights the update made.")
    mode: Literal["interrupt", "restart", "drop"]
    interrupted: int = Field(description="Continued under the new weights.")
    restarted: int = Field(description="Aborted and started again from their prompt.")
    dropped: int = Field(description="Aborted and discarded with their groups.")
    wasted_tokens: int = Field(description="Generated for the restarted and dropped ones.")
    taken_back: int = Field(
        0, description="Of the restarted and dropped, those that had finished (logged)."
    )


class TrainStep(_Record):
    type: Literal["train_step"] = "train_step"
    step: int
    started_t: Seconds
    policy_version: int
    waited_for_gpus_s: NonNegFloat = Field(description="Wait for lent GPUs to come back.")
    # a real trainer's (pearl run); the simulator's trainer writes none of them
    reward_mean: float | None = Field(None, description="The batch's mean reward.")
    loss: float | None = Field(None, description="The update's loss.")
    tokens: NonNegInt | None = Field(None, description="Loss tokens of the batch.")
    sync_s: NonNegFloat | None = Field(None, description="Weight sync to the engines after it.")

    _OMIT_UNSET = ("reward_mean", "loss", "tokens", "sync_s")


class RunEnded(_Record):
    type: Literal["run_ended"] = "run_ended"
    reason: str = ""


Record = Annotated[
    RunStarted
    | GpuAdded
    | GpuRemoved
    | WorkerPhase
    | DecisionMade
    | PlanStepDone
    | AllocationChanged
    | BorrowChanged
    | TrajectoryFinished
    | TurnEnded
    | TrajectoryLost
    | BatchCompleted
    | BatchConsumed
    | PastBoundApplied
    | TrainStep
    | RunEnded,
    Field(discriminator="type"),
]

_ADAPTER: TypeAdapter[Record] = TypeAdapter(Record)
RECORD_TYPES: tuple[str, ...] = tuple(
    model.model_fields["type"].default for model in get_args(get_args(Record)[0])
)


def encode(record: Record) -> dict[str, Any]:
    data: dict[str, Any] = record.model_dump(mode="json")
    fields = type(record).model_fields
    for name in record._OMIT_UNSET:
        if data[name] == fields[name].default:
            del data[name]
    return data


def decode(data: Any) -> Record:
    """One record from its JSON object; ``ValueError`` naming the field otherwise."""
    if isinstance(data, dict) and data.get("v") not in (None, SCHEMA_VERSION):
        raise ValueError(f"v: schema version {data.get('v')!r} is not {SCHEMA_VERSION}")
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(record)"
        raise ValueError(f"{field}: {first['msg']}") from None
