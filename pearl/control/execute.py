"""Executing a :class:`~pearl.core.plan.TransitionPlan` as per-agent commands.

A step is sent to the agent registered for its node as soon as every step it depends on
has succeeded; a step whose dependency failed (or whose agent is lost, or has none) is
aborted without being sent. Each command has a deadline (``deadline_factor`` x the step's
estimated duration, at least ``min_deadline_s``); no ack by then is a timeout.

Role changes are two-phase: the plan drains a worker (``drain``/``migrate``) and then
switches or stops it in a later step that depends on the drain. If the plan fails, every
worker left drained (its drain succeeded, the step after it did not run or failed) gets an
``abort_drain`` command (phase draining -> ready: keep serving in the old role), so an
aborted plan leaves no worker stuck out of service. Compensations to a lost agent are moot.

A :class:`StepListener` (``execute_plan(..., listener=...)``) hears of each step sent: just
before its command goes out (``step_started``) and when its result comes, ok or not
(``step_ended``; a start's or wake's result carries the engine's URL its agent reported),
and of each compensation's result (``drain_undone``). A step never sent (aborted, or no
agent for its node) is heard of neither way. The router's is
``pearl.router.steps_client.RouterSteps`` (docs/router.md, "Plan steps"). The listener is
called on the plan's thread, so its calls hold the plan up for as long as they take (keep
them short); one that raises is logged and the plan goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pearl.control.coordinator_side import CommandResult, CommandStatus, ControlServer
from pearl.control.messages import Command, ControlAction
from pearl.core.plan import Action, PlanStep, TransitionPlan

log = logging.getLogger(__name__)
DRAINING_ACTIONS = frozenset({Action.DRAIN, Action.MIGRATE})


@dataclass(frozen=True)
class PlanStepResult:
    step_id: int
    status: CommandStatus
    agent_id: str | None
    error: str | None
    elapsed_s: float
    ended_s: float = 0.0  # when the result came, seconds after the plan started
    url: str | None = None  # a start's or wake's engine: its base URL, from its agent's ack

    @property
    def ok(self) -> bool:
        return self.status is CommandStatus.OK


class StepListener(Protocol):
    """Hears of a plan's steps as :func:`execute_plan` sends them and their results come."""

    def step_started(self, step: PlanStep) -> None:
        """``step``'s command is about to be sent."""
        ...

    def step_ended(self, step: PlanStep, result: PlanStepResult) -> None:
        """``step``'s result came (``result.ok`` or not)."""
        ...

    def drain_undone(self, step: PlanStep, result: PlanStepResult) -> None:
        """The ``abort_drain`` of drain (or migrate) ``step`` came back: with
        ``result.ok`` its worker serves again in its old role."""
        ...


@dataclass
class PlanResult:
    steps: dict[int, PlanStepResult] = field(default_factory=dict)
    compensations: dict[str, PlanStepResult] = field(default_factory=dict)  # worker -> abort_drain
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.status is CommandStatus.OK for r in self.steps.values())

    def carried_out(self) -> frozenset[int]:
        """The steps whose effect stands: acknowledged, less the drains undone by a
        successful ``abort_drain`` (the worker serves in its old role again)."""
        undone = {c.step_id for c in self.compensations.values() if c.status is CommandStatus.OK}
        return frozenset(
            sid
            for sid, r in self.steps.items()
            if r.status is CommandStatus.OK and sid not in undone
        )


def _deadline(step: PlanStep, factor: float, minimum: float) -> float:
    return max(minimum, factor * step.duration_s)


def execute_plan(
    server: ControlServer,
    plan: TransitionPlan,
    *,
    deadline_factor: float = 3.0,
    min_deadline_s: float = 5.0,
    listener: StepListener | None = None,
) -> PlanResult:
    """Run ``plan``'s steps on the agents (the module docstring); ``listener`` hears of
    each step sent, and of each compensation."""
    t0 = time.monotonic()
    result = PlanResult()
    steps = {s.step_id: s for s in plan.steps}
    waiting = dict(steps)
    in_flight: dict[str, PlanStep] = {}
    while waiting or in_flight:
        batch: list[tuple[str, Command]] = []
        for sid, step in list(waiting.items()):
            deps = [result.steps.get(d) for d in step.depends_on]
            if any(d is not None and d.status is not CommandStatus.OK for d in deps):
                bad = next(d for d in deps if d is not None and d.status is not CommandStatus.OK)
                result.steps[sid] = PlanStepResult(
                    sid,
                    CommandStatus.ABORTED,
                    None,
                    f"dependency {bad.step_id} {bad.status}",
                    0.0,
                    _since(t0),
                )
                del waiting[sid]
                continue
            if any(d is None for d in deps):
                continue
            del waiting[sid]
            agent = server.agent_for_node(step.node)
            if agent is None:
                result.steps[sid] = PlanStepResult(
                    sid, CommandStatus.LOST, None, f"no agent on {step.node}", 0.0, _since(t0)
                )
                continue
            cmd = Command(
                cmd_id=server.new_cmd_id(),
                step_id=sid,
                action=step.action,
                worker_id=step.worker_id,
                gpu_ids=step.gpu_ids,
                role=step.role,
                deadline_s=_deadline(step, deadline_factor, min_deadline_s),
            )
            batch.append((agent, cmd))
            in_flight[cmd.cmd_id] = step
        if batch:
            for _, cmd in batch:
                _tell(listener, "step_started", in_flight[cmd.cmd_id])
            server.send_commands(batch)
            continue  # aborts/dispatches may have unlocked more steps
        if not in_flight:
            break
        for cid, r in server.wait_results(in_flight, any_=True).items():
            step = in_flight.pop(cid)
            done = result.steps[step.step_id] = _step_result(step.step_id, r, _since(t0))
            _tell(listener, "step_ended", step, done)
    if not result.ok:
        _compensate(server, plan, result, min_deadline_s, listener)
    result.elapsed_s = time.monotonic() - t0
    return result


def _since(t0: float) -> float:
    return time.monotonic() - t0


def _step_result(step_id: int, r: CommandResult, ended_s: float = 0.0) -> PlanStepResult:
    return PlanStepResult(step_id, r.status, r.agent_id, r.error, r.elapsed_s, ended_s, r.url)


def _tell(listener: StepListener | None, method: str, *args: object) -> None:
    """Call the listener's ``method``; its failure is logged, never the plan's."""
    if listener is None:
        return
    call: Callable[..., None] = getattr(listener, method)
    try:
        call(*args)
    except Exception:
        log.exception("plan step listener: %s failed (the plan goes on)", method)


def _compensate(
    server: ControlServer,
    plan: TransitionPlan,
    result: PlanResult,
    deadline_s: float,
    listener: StepListener | None = None,
) -> None:
    left_drained: dict[str, PlanStep] = {}
    for step in plan.steps:  # topological order: the last step on a worker wins
        r = result.steps.get(step.step_id)
        if step.action in DRAINING_ACTIONS and r is not None and r.status is CommandStatus.OK:
            left_drained[step.worker_id] = step
        elif r is not None and r.status is CommandStatus.OK:
            left_drained.pop(step.worker_id, None)
    cmds: dict[str, tuple[str, PlanStep]] = {}
    batch = []
    for worker, step in left_drained.items():
        agent = server.agent_for_node(step.node)
        if agent is None:
            continue
        cmd = Command(
            cmd_id=server.new_cmd_id(),
            step_id=step.step_id,
            action=ControlAction.ABORT_DRAIN,
            worker_id=worker,
            gpu_ids=step.gpu_ids,
            deadline_s=deadline_s,
        )
        batch.append((agent, cmd))
        cmds[cmd.cmd_id] = (worker, step)
    if not batch:
        return
    server.send_commands(batch)
    for cid, cr in server.wait_results(cmds).items():
        worker, step = cmds[cid]
        done = result.compensations[worker] = _step_result(step.step_id, cr)
        _tell(listener, "drain_undone", step, done)
