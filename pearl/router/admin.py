"""The router's admin routes, mounted by the front (``pearl.router.front``):

- ``POST /pearl/plan_steps``: one phase of one plan step (``pearl.router.plan_steps.
  StepUpdate``: ``{phase: "start"|"end", action, worker_id, role, url, ok, gpu_type,
  tp}``), applied to
  the instance table; 200 ``{"applied": EFFECT or null, "note": ...}``. A body that is not
  such an update is a 400 in vLLM's error shape, ``param`` naming the field (the front's
  handler for the fields' own checks; here for an update that cannot be applied, such as
  the end of a start without the engine's URL).
- ``POST /pearl/workers_lost``: ``{worker_ids: [...], reason}``, workers the coordinator's
  state dropped (an engine that died, an agent gone): out of the table at once; 200
  ``{"removed": [...]}`` (those the table had).
- ``GET /pearl/instances``: the table, ``{"instances": [{worker_id, url, role, phase,
  in_flight, gpu_type, tp}, ...]}`` (``gpu_type`` and ``tp`` null where no plan step said
  them).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pearl.engines.protocol import UntrustedJSONRoute, error_response
from pearl.router.plan_steps import LostWorkers, PlanSteps, StepUpdate


def admin_routes(steps: PlanSteps) -> APIRouter:
    api = APIRouter(prefix="/pearl", route_class=UntrustedJSONRoute)

    @api.post("/plan_steps")
    async def plan_step(body: StepUpdate) -> JSONResponse:
        problem = body.problem()
        if problem is not None:
            field, why = problem
            return error_response(f"{field}: {why}", 400, field)
        applied = steps.apply(body)
        effect = None if applied.effect is None else applied.effect.value
        return JSONResponse({"applied": effect, "note": applied.note})

    @api.post("/workers_lost")
    async def workers_lost(body: LostWorkers) -> JSONResponse:
        return JSONResponse({"removed": steps.lost(body.worker_ids)})

    @api.get("/instances")
    async def instances() -> JSONResponse:
        return JSONResponse(
            {
                "instances": [
                    {
                        "worker_id": i.worker_id,
                        "url": i.url,
                        "role": i.role.value,
                        "phase": i.phase.value,
                        "in_flight": i.load,
                        "gpu_type": i.gpu_type,
                        "tp": i.tp,
                    }
                    for i in steps.table
                ]
            }
        )

    return api
