"""Coordinator-side test process: a ControlServer driven by JSON lines on stdin.

Run as ``mpiexec -n 1 python tests/control/control_harness.py RUN_DIR``. Each stdin line is
an op; each answer is one JSON line on stdout:
``{"op": "wait", "n": N}`` -> agents; ``{"op": "agents"}`` -> all agents with state;
``{"op": "execute", "steps": [...]}`` -> step results; ``{"op": "events"}``; ``{"op": "quit"}``.
With ``"listen": "record"`` (or ``"raise"``: each call raises once recorded) the plan runs
with a listener, and the answer's ``heard`` lists its calls in order:
``[method, step_id, action, worker_id, status or null, url or null]``.
"""

from __future__ import annotations

import json
import os
import sys

from pearl.control.coordinator_side import ControlServer
from pearl.control.execute import PlanStepResult, execute_plan
from pearl.core.pd import PDConfig
from pearl.core.plan import Action, PlanStep, Target, TransitionPlan
from pearl.core.roles import Role


def _plan(steps: list[dict[str, object]]) -> TransitionPlan:
    out = []
    for s in steps:
        role = s.get("role")
        out.append(
            PlanStep(
                step_id=int(s["step_id"]),  # type: ignore[call-overload]
                action=Action(s["action"]),
                worker_id=str(s["worker_id"]),
                node=str(s["node"]),
                gpu_ids=tuple(s.get("gpu_ids", ())),  # type: ignore[arg-type]
                role=None if role is None else Role(role),
                depends_on=tuple(s.get("depends_on", ())),  # type: ignore[arg-type]
                duration_s=float(s.get("duration_s", 0.1)),  # type: ignore[arg-type]
                start_s=0.0,
                reason="test",
            )
        )
    return TransitionPlan(Target(PDConfig()), tuple(out))


class Recorder:
    """A ``StepListener`` that writes down every call (and, with ``raises``, fails it)."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises
        self.heard: list[list[object]] = []

    def _heard(self, method: str, step: PlanStep, r: PlanStepResult | None) -> None:
        status = None if r is None else r.status.value
        url = None if r is None else r.url
        self.heard.append([method, step.step_id, step.action.value, step.worker_id, status, url])
        if self.raises:
            raise RuntimeError(f"listener {method} broke")

    def step_started(self, step: PlanStep) -> None:
        self._heard("step_started", step, None)

    def step_ended(self, step: PlanStep, result: PlanStepResult) -> None:
        self._heard("step_ended", step, result)

    def drain_undone(self, step: PlanStep, result: PlanStepResult) -> None:
        self._heard("drain_undone", step, result)


def main() -> int:
    server = ControlServer.open(
        sys.argv[1],
        heartbeat_s=0.2,
        missed_heartbeats=5,
        knock_host="127.0.0.1",
        accept_timeout_s=2.0,
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "wait":
            agents = server.wait_for_agents(req["n"], req.get("timeout", 30))
            ans: object = {
                a: {"node": i.node, "pid": i.pid, "gpus": [g.id for g in i.gpus]}
                for a, i in agents.items()
            }
        elif op == "agents":
            ans = {
                a: {"state": i.state, "reason": i.reason, "grace_s": i.grace_s}
                for a, i in server.agents.items()
            }
        elif op == "events":
            ans = server.events()
        elif op == "execute":
            listen = req.get("listen")
            listener = None if listen is None else Recorder(raises=listen == "raise")
            res = execute_plan(
                server,
                _plan(req["steps"]),
                min_deadline_s=req.get("min_deadline_s", 5.0),
                listener=listener,
            )
            ans = {
                "ok": res.ok,
                "elapsed_s": res.elapsed_s,
                "steps": {str(k): v.__dict__ for k, v in res.steps.items()},
                "compensations": {k: v.__dict__ for k, v in res.compensations.items()},
                "heard": None if listener is None else listener.heard,
            }
        elif op == "quit":
            server.close()
            print(json.dumps({"bye": True}), flush=True)
            os._exit(0)
        else:
            ans = {"error": f"unknown op {op}"}
        print(json.dumps(ans), flush=True)
    server.close()
    os._exit(0)


if __name__ == "__main__":
    main()
