"""A control plane that acknowledges plan steps without agents: the one fake of the
coordinator's CPU tests (a plain module).

Fakes: ``pearl.coordinator.control_plane.MpiControl``, that is the MPI control plane and the
node agents behind it. Real: the coordinator, its journal, run log, backend and executor.
The real control plane runs with real MPI processes in ``tests/control/`` and under the
coordinator on the Slurm dev cluster in ``tests/coordinator/test_on_slurm.py``.
"""

from __future__ import annotations

from typing import Any

from pearl.coordinator.reconcile import AgentEvent
from pearl.core.execution import PlanOutcome, StepOutcome
from pearl.core.plan import TransitionPlan


class AckingControl:
    """Acknowledges the first ``num_ok`` steps of each plan (None: all) and fails the rest."""

    def __init__(self, num_ok: int | None = None) -> None:
        self.num_ok = num_ok
        self.plans: list[TransitionPlan] = []

    def execute(self, plan: TransitionPlan) -> PlanOutcome:
        self.plans.append(plan)
        n = len(plan.steps) if self.num_ok is None else self.num_ok
        steps = tuple(
            StepOutcome(s.step_id, i < n, "" if i < n else "timeout", 0.0, 0.1)
            for i, s in enumerate(plan.steps)
        )
        ok_ids = frozenset(s.step_id for s in steps if s.ok)
        failed = [f"step {s.step_id}: {s.error}" for s in steps if not s.ok]
        return PlanOutcome(not failed, ok_ids, steps, "; ".join(failed[:3]))

    def events(self) -> list[AgentEvent]:
        return []

    def agents(self) -> list[dict[str, Any]]:
        return []

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        return None
