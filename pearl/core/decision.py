"""What ``decide()`` returns: plain frozen data, each part with its reason.

The shell journals ``Decision.state`` (the observed state the decision was taken on),
then executes the plan, the borrow action and the elastic requests and releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pearl.core.plan import TransitionPlan
from pearl.core.predictor import Prediction
from pearl.core.selection import Selection
from pearl.core.state import ClusterState
from pearl.core.transition_cost import effective_completion_s


class BorrowKind(StrEnum):
    NONE = "none"  # nothing lent and nothing to lend
    KEEP = "keep"  # a borrow window is open and stays open
    LEND = "lend"  # lend the trainer's GPUs to rollout now
    RETURN = "return"  # give them back on schedule (drain, then sleep and onload)
    FORCE_RETURN = "force_return"  # the trainer needs them: migrate in-flight requests away


@dataclass(frozen=True)
class BorrowAction:
    kind: BorrowKind
    gpu_ids: tuple[str, ...] = ()
    return_by_s: float | None = None  # when the trainer must have its GPUs back
    gain_s: float = 0.0  # predicted batch time saved by the lent GPUs
    overhead_s: float = 0.0  # lend plus return transition time
    reason: str = ""


@dataclass(frozen=True)
class ElasticRequest:
    num_gpus: int
    gpu_type: str
    partition: str
    time_limit_min: int


@dataclass(frozen=True)
class ElasticAction:
    requests: tuple[ElasticRequest, ...] = ()
    releases: tuple[str, ...] = ()  # allocations to give back; left out of the rollout pool
    gain_s_per_gpu: float = 0.0  # predicted time saved per requested GPU
    reason: str = ""


@dataclass(frozen=True)
class SwitchVerdict:
    switch: bool
    mandatory: bool  # the pool changed, so the configuration must change
    gain_s: float  # predicted time saved by the target over the current configuration
    cost_s: float  # the transition's makespan
    reason: str


@dataclass(frozen=True)
class Decision:
    time_s: float
    policy: str
    reasons: tuple[str, ...]  # one line per stage, for people and logs
    plan: TransitionPlan
    switch: SwitchVerdict
    borrow: BorrowAction
    elastic: ElasticAction
    current: Prediction  # of the configuration running now, on the batch left
    selection: Selection  # the ranked candidates behind the target
    state: ClusterState  # the state after folding in the observation; last, it is long

    @property
    def predicted_s(self) -> float:
        """The batch left, predicted to complete this long from the decision: under the
        configuration running now, or, with a plan, as the selection ranked the target:
        the engines it keeps serve through the plan's makespan, the target the rest
        (``transition_cost.effective_completion_s``; the makespan then the target's whole
        completion where it keeps none). What the simulator and a run score the predictor
        on (``batch_completed.predicted_s``)."""
        if self.plan.empty:
            return self.current.completion_s
        best = self.selection.best
        return effective_completion_s(
            self.plan.makespan_s, best.kept_share, best.completion_s, self.current.completion_s
        )

    def summary(self) -> str:
        """A few lines for people: what was decided and why."""
        lines = [f"t={self.time_s:.1f}s policy={self.policy} state v{self.state.version}"]
        lines += [f"- {r}" for r in self.reasons]
        return "\n".join(lines)
