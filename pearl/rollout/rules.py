"""The rules of an asynchronous rollout: groups, the staleness bound, admission, batching.

What the systems pearl competes with do, and the names they give it:
- AReaL: ``max_head_offpolicyness`` (here ``max_staleness_versions``),
  ``max_concurrent_rollouts`` (``max_in_flight``), ``consumer_batch_size``
  (``batch_trajectories``); interruptible generation (``PastBound.INTERRUPT``).
- slime: ``n_samples_per_prompt`` (``group_size``); the first finished groups make the
  batch (``Batching.FIRST_COMPLETED``); ``--partial-rollout`` keeps partial groups.
- ROLL: ``async_generation_ratio`` (the staleness bound), ``group_size``; groups past the
  ratio dropped (``PastBound.DROP``) or resent with their partial output.

Admission, in trajectories (AReaL's rule, rounded down to whole groups):
``min(max_in_flight - running, (max_staleness_versions + updates + 1) * B - (accepted +
running))``, where ``running`` counts admitted, unfinished trajectories and ``accepted``
the finished ones not dropped (consumed or waiting). With nothing dropped and no
``max_in_flight`` this is "batch ``b`` may start after update ``b - max_staleness``".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Batching(StrEnum):
    """How the trainer's next batch is formed."""

    FIRST_COMPLETED = "first-completed"  # the first B / group_size complete groups
    IN_ORDER = "in-order"  # batch b: trajectories b*B .. (b+1)*B - 1, all of them


class PastBound(StrEnum):
    """What becomes of a trajectory that an update puts past the staleness bound."""

    INTERRUPT = "interrupt"  # continue under the new weights with its partial output
    RESTART = "restart"  # abort, start again from its prompt (its tokens wasted)
    DROP = "drop"  # abort and discard it with its group (its tokens wasted)


@dataclass(frozen=True, slots=True)
class RolloutRules:
    batch_trajectories: int  # B, a multiple of group_size
    max_staleness_versions: int  # η: consumed at most this many versions after admission
    group_size: int = 1  # samples per prompt (a GRPO group)
    # running trajectories at most (None: unbounded), as admission goes: a finished
    # trajectory that an update starts again (past the bound) runs again unadmitted and may
    # take running past it for a while; no group is admitted until running is below it
    max_in_flight: int | None = None
    batching: Batching = Batching.FIRST_COMPLETED
    past_bound: PastBound = PastBound.INTERRUPT
    initial_version: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.batch_trajectories < 1:
            raise ValueError("batch_trajectories and group_size must be >= 1")
        if self.batch_trajectories % self.group_size:
            raise ValueError(
                f"batch_trajectories: {self.batch_trajectories} is not a multiple of "
                f"group_size {self.group_size}"
            )
        if self.max_staleness_versions < 0:
            raise ValueError("max_staleness_versions must be >= 0")
        if self.max_in_flight is not None and self.max_in_flight < self.group_size:
            raise ValueError(
                f"max_in_flight: {self.max_in_flight} is below group_size {self.group_size}"
            )

    @property
    def groups_per_batch(self) -> int:
        return self.batch_trajectories // self.group_size
