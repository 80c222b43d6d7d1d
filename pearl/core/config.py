"""Typed configuration of the decision policies; every field documented.

One ``PolicyConfig`` picks, by name, the same code in the simulator and on the cluster.
Validation errors name the field; the shell adds the file name.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pearl.core.limits import (
    MAX_ALLOCATIONS,
    MAX_GPUS,
    MAX_SECONDS,
    NonNegFloat,
    PositiveSeconds,
    Seconds,
)
from pearl.core.state import Frozen

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Count = Annotated[int, Field(ge=1, le=1_000_000)]


class SelectionConfig(Frozen):
    exhaustive_limit: Count = Field(
        256,
        description="Evaluate every P:D split and TP pair when there are at most this many "
        "candidates; above it, search the split per TP pair (see docs/architecture.md).",
    )
    top_k: Annotated[int, Field(ge=1, le=1_000)] = Field(
        8, description="Candidates kept for the logs."
    )
    modes: Literal["any", "colocated", "disaggregated"] = Field(
        "any", description="PD modes the selection may choose (baselines fix one)."
    )


class SwitchingConfig(Frozen):
    rule: str = Field("margin", description="Switching rule by name: margin, always, never.")
    min_gain_s: Seconds = Field(
        10.0, description="Switch only if the predicted time saved beats the transition by this."
    )
    min_gain_fraction: Fraction = Field(
        0.05, description="...and by this share of the current predicted completion time."
    )
    min_dwell_s: Seconds = Field(
        60.0, description="No voluntary switch sooner than this after the previous one."
    )


class BorrowingConfig(Frozen):
    rule: str = Field(
        "predictive", description="Borrowing rule by name: predictive, always, never."
    )
    max_return_delay_s: PositiveSeconds = Field(
        30.0, description="Longest the trainer may wait for its lent GPUs once it needs them."
    )
    # 1 s: the trainer's GPUs are idle while it waits for its batch, so lending costs it
    # nothing but the return, which ends as the batch completes; the offload and wake are in
    # the prediction and the return's cost to the batch is taken off the gain
    # (policies/borrowing.py). The old 5 s, on top of the whole return, declined lends that
    # shortened a throughput-bound batch by a tenth (6-7 s of 55-60 s), which RLBoost's
    # always-lend controller took.
    min_gain_s: Seconds = Field(
        1.0,
        description="Lend only if the predicted batch time saved, net of the return, beats this.",
    )
    return_margin_s: Seconds = Field(
        5.0, description="Start returning this long before the return must be complete."
    )
    lend_fraction: Fraction = Field(
        1.0, description="Rule always: share of the trainer's nodes to lend (rounded up)."
    )


class ElasticConfig(Frozen):
    rule: str = Field(
        "marginal-gain", description="Elastic rule by name: marginal-gain, greedy, never."
    )
    partition: str = Field("elastic", description="Slurm partition (or QOS) of elastic jobs.")
    gpu_type: str = Field("h100", description="GPU type to request.")
    gpus_per_allocation: Annotated[int, Field(ge=1, le=MAX_GPUS)] = Field(
        8, description="GPUs per request."
    )
    max_allocations: Annotated[int, Field(ge=0, le=MAX_ALLOCATIONS)] = Field(
        4, description="Most elastic allocations pending or held at once."
    )
    time_limit_min: Annotated[int, Field(ge=1, le=MAX_SECONDS // 60)] = Field(
        60, description="Slurm time limit."
    )
    expected_window_s: PositiveSeconds = Field(
        1800.0, description="Expected life of a grant when Slurm gives no end time."
    )
    min_window_factor: Annotated[float, Field(ge=1.0, le=1e6)] = Field(
        3.0, description="Use a grant only if its remaining window is this many cold starts."
    )
    # 0.05 s: elastic GPUs are other tenants' idle capacity, granted preemptibly at no
    # price, so a node is worth taking whenever its predicted gain is above noise (1/4,000
    # of a ~200 s batch per GPU); the cold start is already in the prediction. The old
    # default of 1.0 s suited GPUs that cost money and declined most grants of the
    # shipped scenarios, which overrode it (issue 18: one default for every scenario).
    min_gain_s_per_gpu: NonNegFloat = Field(
        0.05, description="Request more only if the predicted time saved per GPU beats this."
    )


class PolicyConfig(Frozen):
    policy: str = Field("pearl", description="Decision policy by name (see pearl.core.registry).")
    selection: SelectionConfig = SelectionConfig()
    switching: SwitchingConfig = SwitchingConfig()
    borrowing: BorrowingConfig = BorrowingConfig()
    elastic: ElasticConfig = ElasticConfig()
