"""The coordinator's side of the MPI control plane, as the loop uses it.

``MpiControl`` opens the port the node agents connect to (``pearl.control``), executes
plans on them (one acknowledged command per step, aborts on failure), reports what
happened to the agents since the last tick (``AgentEvent``) and the agents it knows, which
the loop writes to ``run_dir/agents.json`` every tick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pearl.coordinator.reconcile import AgentEvent
from pearl.core.execution import PlanOutcome, StepOutcome
from pearl.core.plan import TransitionPlan
from pearl.io.atomic import write_text_atomic

if TYPE_CHECKING:
    from pearl.control.coordinator_side import ControlServer
    from pearl.control.execute import PlanResult
    from pearl.router.steps_client import RouterSteps


class MpiControl:
    def __init__(self, server: ControlServer, router: RouterSteps | None = None) -> None:
        self.server = server
        self.router = router  # told of every plan step (None: no router to tell)

    @classmethod
    def open(cls, run_dir: Path, router_url: str | None = None) -> MpiControl:
        """The control server of ``run_dir``, open (MPI initialised, port file written),
        and the router at ``router_url`` told of the plans' steps."""
        from pearl.control.coordinator_side import ControlServer  # initialises MPI

        router = None
        if router_url is not None:
            from pearl.router.steps_client import RouterSteps

            router = RouterSteps(router_url)
        return cls(ControlServer.open(run_dir), router)

    def execute(self, plan: TransitionPlan) -> PlanOutcome:
        from pearl.control.execute import execute_plan

        return plan_outcome(execute_plan(self.server, plan, listener=self.router))

    def events(self) -> list[AgentEvent]:
        """What happened to agents since the last call, with their node and workers."""
        events = self.server.events()
        known = {a.agent_id: a for a in self.server.agents_snapshot()}  # after: joins included
        out = []
        for ev in events:
            a = known.get(ev.agent_id)  # None: refused before it said who it is
            if a is None:
                out.append(AgentEvent(ev.kind, ev.agent_id, "", ev.detail))
                continue
            workers = ev.workers if ev.kind == "exited" else a.workers
            out.append(
                AgentEvent(ev.kind, ev.agent_id, a.node, ev.detail, workers, a.grace_s, a.job_id)
            )
        return out

    def agents(self) -> list[dict[str, Any]]:
        return [
            {
                "agent_id": a.agent_id,
                "node": a.node,
                "gpus": [g.id for g in a.gpus],
                "job_id": a.job_id,
                "state": a.state.value,
            }
            for a in self.server.agents_snapshot()
        ]

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        if self.router is not None:
            self.router.workers_lost(worker_ids, reason)

    def close(self, restarting: bool = False) -> None:
        """Close the server; ``restarting``: the agents wait for the next incarnation."""
        self.server.close(restarting)
        if self.router is not None:
            self.router.close()


def plan_outcome(result: PlanResult) -> PlanOutcome:
    """A control plane's ``PlanResult`` as the core's ``PlanOutcome`` (``MpiControl``'s and
    ``pearl.run.control.LocalControl``'s)."""
    from pearl.control.coordinator_side import CommandStatus

    steps = tuple(
        StepOutcome(
            r.step_id,
            r.status is CommandStatus.OK,
            r.error or "",
            max(0.0, r.ended_s - r.elapsed_s),
            r.ended_s,
        )
        for r in sorted(result.steps.values(), key=lambda r: r.ended_s)
    )
    failed = [f"step {s.step_id}: {s.error}" for s in steps if not s.ok]
    return PlanOutcome(result.ok, result.carried_out(), steps, "; ".join(failed[:3]))


def write_agents(path: Path, agents: list[dict[str, Any]]) -> None:
    """Atomically replace ``path`` with the agents' list (readers never see half)."""
    write_text_atomic(path, json.dumps(agents) + "\n")
