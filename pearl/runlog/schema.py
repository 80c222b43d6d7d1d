"""The run log: one JSON object per line, one schema for simulated and real runs.

Every record carries ``v`` (the schema version), ``t`` (the run's clock, seconds since
its start) and ``type``; the other fields depend on the type (``docs/log-schema.md``
lists them). The simulator and the coordinator write the same records, so one analysis
reads both. Pure: no I/O; ``pearl.runlog.jsonl`` writes and reads files.

Invariants: a record round-trips through ``encode``/``decode`` unchanged; ``decode``
rejects an unknown type, a missing field or a wrong version with a ``ValueError`` naming
the field, so a reader can skip and count bad lines instead of crashing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, TypeAdapter, ValidationError

from pearl.core.state import Frozen, NonNegFloat

SCHEMA_VERSION = 1

Seconds = NonNegFloat


class _Record(Frozen):
    v: Literal[1] = 1  # SCHEMA_VERSION
    t: Seconds = Field(description="Run clock (s since the run started).")


class RunStarted(_Record):
    type: Literal["run_started"] = "run_started"
    run_id: str
    source: Literal["simulator", "coordinator"]
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
    batch_id: int
    num_turns: int
    output_tokens: int
    min_policy_version: int = Field(description="Oldest policy version among its tokens.")


class BatchCompleted(_Record):
    type: Literal["batch_completed"] = "batch_completed"
    batch_id: int
    started_t: Seconds
    predicted_s: float | None = Field(description="Predicted at the batch's first decision.")


class TrainStep(_Record):
    type: Literal["train_step"] = "train_step"
    step: int
    started_t: Seconds
    policy_version: int
    waited_for_gpus_s: NonNegFloat = Field(description="Wait for lent GPUs to come back.")


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
    | BatchCompleted
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
