"""The coordinator's plan steps on the router's instance table, while traffic flows.

What a step does to the serving set is the core's ``pearl.core.execution.STEP_EFFECTS``
(the effect at the step's start and at its end), the table the simulator's fleet follows
(``pearl/sim/execution.py``); here it acts on a :class:`~pearl.router.router.Router`:

- stop_admitting (drain, at its start): ``draining``, no new turns; those in flight finish
  there;
- leave (migrate, at its start): ``Router.migrate``, draining, its requests aborted and each
  turn continued elsewhere;
- leave (switch, at its start): ``switching``, out of traffic (anything still in flight
  continues elsewhere);
- leave (sleep, stop, at their start): out of traffic, its requests aborted and continued
  elsewhere, then out of the table;
- join (start, wake, at their end): added at the URL its agent reported, and ready in the
  step's role;
- join (switch, at its end): ready in its new role (a routing change: a ``kv_both`` engine);
- pause, trainer_off, trainer_on (sync_weights, offload, onload): nothing (the engine pauses
  itself; the trainer is not the router's).

A step that failed (``ok`` false at its end) joins nothing; a failed plan's compensation,
the control plane's ``abort_drain`` (``drain_undone``), makes a drained worker ready again in
its old role, also one a failed sleep or stop already took out of the table. Where a
leave aborts requests, the table changes at once and the aborts run on in the background
(:meth:`PlanSteps.settle` waits for them): the step's command, sent next, finds its engine
emptying. A step naming a worker the router does not have is ignored with a warning, as
is a join with no URL to go to. Besides the steps, :meth:`PlanSteps.lost`: workers the
coordinator's state dropped (their engine died, their agent or node went) leave the table
at once; a turn in flight there comes back unanswered and is routed again. The HTTP side
is ``pearl.router.admin`` (the routes) and ``pearl.router.steps_client`` (the coordinator's
listener); docs/router.md, "Plan steps".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
)

from pearl.control.messages import ControlAction
from pearl.core.execution import STEP_EFFECTS, StepEffect
from pearl.core.plan import Action
from pearl.core.roles import Phase, Role
from pearl.router.instances import Instance, InstanceTable
from pearl.router.router import Router

log = logging.getLogger(__name__)

SERVING_ROLES = frozenset({Role.COLOCATED, Role.PREFILL, Role.DECODE})
ROUTER_EFFECTS = frozenset({StepEffect.STOP_ADMITTING, StepEffect.LEAVE, StepEffect.JOIN})
StepPhase = Literal["start", "end"]


def effect_of(action: Action | ControlAction, phase: StepPhase) -> StepEffect | None:
    """The step's effect at its start or end (``STEP_EFFECTS``); ``abort_drain`` has none."""
    if not isinstance(action, Action):
        return None
    start, end = STEP_EFFECTS[action]
    return start if phase == "start" else end


def concerns_router(action: Action | ControlAction, phase: StepPhase) -> bool:
    """Whether the router does anything at this phase of the step (the end of a step it
    acted on at its start included: a failed one is undone)."""
    if action is ControlAction.ABORT_DRAIN or effect_of(action, phase) in ROUTER_EFFECTS:
        return True
    return phase == "end" and effect_of(action, "start") in ROUTER_EFFECTS


@dataclass(frozen=True)
class Applied:
    """What one phase of a step did to the table: the effect applied, or None (nothing to
    do here, or ignored: ``note`` says why)."""

    effect: StepEffect | None
    note: str = ""


_ACTIONS: dict[str, Action | ControlAction] = {a.value: a for a in (*Action, *ControlAction)}
MAX_WORKER_ID_CHARS = 256
MAX_URL_CHARS = 2048
MAX_GPU_TYPE_CHARS = 64
MAX_TP = 64


class StepUpdate(BaseModel):
    """One phase of one plan step, as the coordinator's listener posts it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    phase: StepPhase
    action: Action | ControlAction
    worker_id: StrictStr = Field(min_length=1, max_length=MAX_WORKER_ID_CHARS)
    role: Role | None = None  # the role after the step (start, wake, switch)
    url: StrictStr | None = Field(None, max_length=MAX_URL_CHARS)  # from its agent's ack
    ok: StrictBool = True  # at the end: whether the step succeeded
    # what the engine runs on (start, wake): the router weighs its load by its speed
    gpu_type: StrictStr | None = Field(None, min_length=1, max_length=MAX_GPU_TYPE_CHARS)
    tp: StrictInt | None = Field(None, ge=1, le=MAX_TP)

    @field_validator("action", mode="before")
    @classmethod
    def _action(cls, value: Any) -> Action | ControlAction:
        if isinstance(value, str) and value in _ACTIONS:
            return _ACTIONS[value]
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"unknown action {shown} (one of {', '.join(_ACTIONS)})")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) base URL: {value[:80]!r}")
        return value

    def problem(self) -> tuple[str, str] | None:
        """The field that makes this update impossible to apply, and why; None if none."""
        if self.action is ControlAction.ABORT_DRAIN and self.phase != "end":
            return "phase", "abort_drain has only an end"
        if self.phase == "end" and self.ok and effect_of(self.action, "end") is StepEffect.JOIN:
            if self.role is None:
                return "role", f"the end of a {self.action.value} names the role it joins in"
            needs_url = self.action in (Action.START, Action.WAKE) and self.role in SERVING_ROLES
            if needs_url and self.url is None:
                return "url", f"the end of a {self.action.value} needs the engine's URL"
        return None


MAX_REASON_CHARS = 2000  # of a ``LostWorkers`` reason


class LostWorkers(BaseModel):
    """Workers the coordinator's state dropped (``POST /pearl/workers_lost``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    worker_ids: tuple[
        Annotated[StrictStr, Field(min_length=1, max_length=MAX_WORKER_ID_CHARS)], ...
    ] = Field(max_length=4096)
    reason: StrictStr = Field(default="", max_length=MAX_REASON_CHARS)


class PlanSteps:
    """Applies plan steps to one router's table (the module docstring). Its methods are
    called on the router's event loop (they start tasks there)."""

    def __init__(self, router: Router, *, leave_timeout_s: float = 60.0) -> None:
        self.router = router
        self.leave_timeout_s = leave_timeout_s
        self._leaving: dict[str, asyncio.Task[None]] = {}  # worker -> its aborts
        self._left: dict[str, Instance] = {}  # taken out of the table by a sleep or stop

    @property
    def table(self) -> InstanceTable:
        return self.router.table

    def apply(self, update: StepUpdate) -> Applied:
        if update.action is ControlAction.ABORT_DRAIN:
            return self.drain_undone(update.worker_id, update.ok)
        assert isinstance(update.action, Action)
        if update.phase == "start":
            return self.start(update.action, update.worker_id)
        return self.end(
            update.action,
            update.worker_id,
            update.role,
            update.url,
            update.ok,
            update.gpu_type,
            update.tp,
        )

    # -- the phases of a step ------------------------------------------------------------

    def start(self, action: Action, worker_id: str) -> Applied:
        """``action``'s step on ``worker_id`` begins."""
        effect = effect_of(action, "start")
        if effect not in ROUTER_EFFECTS:
            return Applied(None, f"{action.value}: nothing for the router at its start")
        if worker_id not in self.table:
            log.warning("plan step %s of %s: not in the router's table, ignored", action, worker_id)
            return Applied(None, f"{worker_id} is not in the router's table")
        self._cancel_leave(worker_id)
        if effect is StepEffect.STOP_ADMITTING:
            self.table.drain(worker_id)
            return Applied(effect, "draining: its turns in flight finish there")
        if action is Action.SWITCH:
            inst = self.table.switching(worker_id)
            self._leave(inst, remove=False)
            return Applied(effect, "switching: out of traffic")
        inst = self.table.drain(worker_id)
        if action is Action.MIGRATE:
            self._leave(inst, remove=False)
            return Applied(effect, f"migrating {inst.load} requests")
        self._leave(inst, remove=True)  # sleep, stop
        return Applied(effect, f"leaving the table once its {inst.load} requests are back")

    def end(
        self,
        action: Action,
        worker_id: str,
        role: Role | None = None,
        url: str | None = None,
        ok: bool = True,
        gpu_type: str | None = None,
        tp: int | None = None,
    ) -> Applied:
        """``action``'s step on ``worker_id`` has ended (``ok`` or not); ``role`` is the
        step's, ``url`` the engine's its agent reported (start, wake), ``gpu_type`` and
        ``tp`` what it runs on (start, wake; the router weighs its load by them)."""
        effect = effect_of(action, "end")
        if not ok and effect_of(action, "start") in ROUTER_EFFECTS:
            # the step did not happen (the coordinator's state keeps the worker as it
            # was): what its start did here is undone, as a failed plan's drain is
            undone = self.drain_undone(worker_id)
            return Applied(undone.effect, f"{action.value} of {worker_id} failed: {undone.note}")
        if effect is not StepEffect.JOIN:
            return Applied(None, f"{action.value}: nothing for the router at its end")
        if not ok:
            return Applied(None, f"{action.value} of {worker_id} failed: nothing joins")
        if role not in SERVING_ROLES:
            log.warning("plan step %s of %s: role %s not served, ignored", action, worker_id, role)
            return Applied(None, f"role {role} is not one the router serves")
        self._cancel_leave(worker_id)
        self._left.pop(worker_id, None)
        if worker_id in self.table:
            inst = self.table.get(worker_id)
            if url is not None:
                inst.url = url.rstrip("/")
            self.table.switch(worker_id, role)
            self.router.describe(worker_id, gpu_type, tp)  # weighed for its role
            return Applied(effect, f"ready as {role.value}")
        if url is None:
            log.warning("plan step %s of %s: no URL to route to, ignored", action, worker_id)
            return Applied(None, f"{worker_id} has no URL")
        self.table.add(worker_id, url, role)
        self.router.describe(worker_id, gpu_type, tp)
        self.table.ready(worker_id)
        return Applied(effect, f"added and ready as {role.value}")

    def drain_undone(self, worker_id: str, ok: bool = True) -> Applied:
        """The control plane undid the drain of ``worker_id`` (a failed plan's
        compensation): with ``ok`` it serves again in its old role."""
        if not ok:
            return Applied(None, f"abort_drain of {worker_id} failed: it stays out")
        self._cancel_leave(worker_id)
        left = self._left.pop(worker_id, None)
        if worker_id not in self.table:
            if left is None:
                log.warning("abort_drain of %s: not in the router's table, ignored", worker_id)
                return Applied(None, f"{worker_id} is not in the router's table")
            back = self.table.add(
                worker_id, left.url, left.role, left.engine, left.gpu_type, left.tp
            )
            back.weight_version = left.weight_version  # it may have slept through a publish
            self.router.reweigh()
        self.table.ready(worker_id)
        return Applied(StepEffect.JOIN, "ready again in its old role")

    def lost(self, worker_ids: Iterable[str]) -> list[str]:
        """Take workers that are gone (the coordinator's ``WorkersLost``) out of the table
        at once, with no aborts to send (nothing answers there): those it had."""
        out = []
        for wid in worker_ids:
            self._cancel_leave(wid)
            self._left.pop(wid, None)
            if wid in self.table:
                self.table.remove(wid)
                out.append(wid)
        if out:
            log.warning("lost, out of the table: %s", ", ".join(out))
            self.router.reweigh()
        return out

    async def settle(self) -> None:
        """Until every leave's aborts are done (and its instance out of the table)."""
        while self._leaving:
            await asyncio.gather(*self._leaving.values(), return_exceptions=True)

    # -- leaving -------------------------------------------------------------------------

    def _leave(self, inst: Instance, *, remove: bool) -> None:
        """Abort ``inst``'s requests in flight until none is left (each turn goes on
        elsewhere), then, with ``remove``, take it out of the table."""

        async def run() -> None:
            try:
                await self.router.abort_in_flight(inst, self.leave_timeout_s)
            except TimeoutError:
                log.warning(
                    "%s: %d requests still in flight after %.0f s of aborts",
                    inst.worker_id,
                    inst.load,
                    self.leave_timeout_s,
                )
            finally:
                if self._leaving.get(inst.worker_id) is task:
                    del self._leaving[inst.worker_id]
            wid = inst.worker_id
            if remove and inst.phase is Phase.DRAINING and self._holds(wid, inst):
                self.table.remove(wid)
                self._left[wid] = inst
                self.router.reweigh()

        task = asyncio.get_running_loop().create_task(run())
        self._leaving[inst.worker_id] = task

    def _holds(self, worker_id: str, inst: Instance) -> bool:
        return worker_id in self.table and self.table.get(worker_id) is inst

    def _cancel_leave(self, worker_id: str) -> None:
        """A new step on the worker: its earlier leave's aborts stop (it takes traffic
        again, or another step takes over)."""
        task = self._leaving.pop(worker_id, None)
        if task is not None:
            task.cancel()
