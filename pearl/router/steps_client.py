"""The coordinator's side of the router's plan-step route: :class:`RouterSteps`, a
``pearl.control.execute.StepListener`` that posts each phase of each plan step the router
acts on (``pearl.router.plan_steps.concerns_router``) to ``ROUTER/pearl/plan_steps``.

``execute_plan(server, plan, listener=RouterSteps(url))`` calls it on the plan's thread
just before a step's command goes out and when its result comes, so each post holds the
plan up: it has a short timeout, and a failed post (the router down, slow, or refusing the
update) is logged and dropped. The plan never waits on the router for longer than that,
and never fails because of it; a router that missed a step is out of step with the plan
until the next one on that worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import httpx

from pearl.control.messages import ControlAction
from pearl.core.plan import PlanStep
from pearl.io.untrusted import MAX_DOCUMENT_BYTES, loads_json
from pearl.router.plan_steps import MAX_REASON_CHARS, StepPhase, concerns_router

if TYPE_CHECKING:
    from pearl.control.execute import PlanStepResult

log = logging.getLogger(__name__)
PLAN_STEPS_PATH = "/pearl/plan_steps"
WORKERS_LOST_PATH = "/pearl/workers_lost"


class RouterSteps:
    def __init__(
        self, router_url: str, *, timeout_s: float = 2.0, client: httpx.Client | None = None
    ) -> None:
        self.url = router_url.rstrip("/") + PLAN_STEPS_PATH
        self.lost_url = router_url.rstrip("/") + WORKERS_LOST_PATH
        self.timeout_s = timeout_s
        self._client = client or httpx.Client(timeout=timeout_s)
        self.dropped = 0  # posts that failed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RouterSteps:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- StepListener ------------------------------------------------------------------

    def step_started(self, step: PlanStep) -> None:
        self._step(step, "start", None, True)

    def step_ended(self, step: PlanStep, result: PlanStepResult) -> None:
        self._step(step, "end", result.url, result.ok)

    def drain_undone(self, step: PlanStep, result: PlanStepResult) -> None:
        self.post(
            {
                "phase": "end",
                "action": ControlAction.ABORT_DRAIN.value,
                "worker_id": step.worker_id,
                "ok": result.ok,
            }
        )

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        """Workers the coordinator's state dropped: out of the router's table (the reason
        cut to what the route takes: an agent's report can be longer)."""
        body = {"worker_ids": list(worker_ids), "reason": reason[:MAX_REASON_CHARS]}
        self.post(body, self.lost_url)

    # -- posting -----------------------------------------------------------------------

    def _step(self, step: PlanStep, phase: StepPhase, url: str | None, ok: bool) -> None:
        if not concerns_router(step.action, phase):
            return
        body: dict[str, Any] = {
            "phase": phase,
            "action": step.action.value,
            "worker_id": step.worker_id,
            "role": None if step.role is None else step.role.value,
            "url": url,
            "ok": ok,
        }
        if step.gpu_type:  # an engine that joins: what it runs on, the router weighs it by
            body |= {"gpu_type": step.gpu_type, "tp": len(step.gpu_ids)}
        self.post(body)

    def post(self, body: dict[str, Any], url: str | None = None) -> dict[str, Any] | None:
        """Post one update (to the plan-step route unless ``url``); its answer, or None
        (logged and dropped) if it failed."""
        what = f"{body.get('action')} {body.get('phase')} of {body.get('worker_id')}"
        if "worker_ids" in body:
            what = f"workers lost {body['worker_ids']}"
        url = url or self.url
        try:
            resp = self._client.post(url, json=body, timeout=self.timeout_s)
            if resp.status_code == 200:
                answer = loads_json(resp.content, max_bytes=MAX_DOCUMENT_BYTES)
                if isinstance(answer, dict):
                    return answer
                raise ValueError("the answer is not a JSON object")
            why = f"HTTP {resp.status_code}: {resp.text[:500]}"
        except (httpx.HTTPError, ValueError) as err:
            why = f"{type(err).__name__}: {err}"
        self.dropped += 1
        log.warning("router %s: %s dropped: %s", url, what, why)
        return None
