"""The inference instances of a simulated run and the router in front of them.

Each instance wraps one ``EngineModel`` (per request, per scheduler step) and runs one
step at a time on the simulator's clock: ``start_step`` runs an idle instance's next
step (the engine computes it at once), the caller schedules the step's end, and
``end_step`` hands over its results (finished turns, KV handoffs). Nothing here keeps a
clock or a heap.

Routing (a vLLM router with prefix affinity): a turn goes to the instance that served
the trajectory's previous turn while that instance accepts requests and has none queued
(its prefix is cached there), else to the least-loaded entry instance: colocated, or prefill when
decode instances exist to take the KV. A prefill instance's handoff goes to the
least-loaded decode instance after the KV transfer. With no entry instance (every one
starting, switching or gone) a turn is parked and routed when one joins.

Multi-step: an instance runs many decode steps in one call, but never past the next
request it knows will arrive (``due_s``, a turn coming back from its tool call or a KV
transfer), so arrivals are admitted at the step boundary vLLM would admit them at. A
request routed to it during a step waits for the step to end, as in vLLM.

Invariants: a request is in exactly one place (an engine, in flight to one, or parked);
``remove`` (and ``stop_accepting`` for the queued ones) returns every request an
instance holds, with the tokens it generated, so a caller can route their continuations;
the caller hands on a step in flight first (``Simulation.take_off``): nothing is lost.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.serving.requests import PartialOutput, Request
from pearl.sim.engine import EngineModel, EngineStepResult, KvHandoff

MAX_STEPS_PER_CALL = 4096


@dataclass
class Instance:
    worker_id: str
    role: Role
    gpu_type: str
    node: str
    tp: int
    engine: EngineModel
    weights_version: int
    busy_until_s: float | None = None  # end of the step in flight
    step_started_s: float = 0.0
    result: EngineStepResult | None = None
    paused_until_s: float = 0.0  # e.g. loading new weights
    due: list[tuple[float, str]] = field(default_factory=list)  # (arrival time, request id)
    num_assigned: int = 0  # requests in flight to it (tool call or KV transfer)

    @property
    def load(self) -> int:
        return self.engine.num_running + self.engine.num_waiting + self.num_assigned

    def next_due_s(self, now_s: float) -> float:
        while self.due and self.due[0][0] < now_s:
            heapq.heappop(self.due)
        return self.due[0][0] if self.due else math.inf


class Fleet:
    """Instances by worker id, the trajectory-to-instance affinity, parked requests."""

    def __init__(self, profile: RuntimeProfile) -> None:
        self.profile = profile
        self.instances: dict[str, Instance] = {}
        self.accepting: set[str] = set()
        self.affinity: dict[str, str] = {}  # traj id -> instance of its last turn
        self.parked: list[Request] = []

    # --- membership --------------------------------------------------------------------

    def add(
        self, worker_id: str, role: Role, gpu_type: str, node: str, tp: int, version: int
    ) -> Instance:
        engine = EngineModel.from_profile(role, self.profile, gpu_type, tp)
        inst = Instance(worker_id, role, gpu_type, node, tp, engine, version)
        self.instances[worker_id] = inst
        self.accepting.add(worker_id)
        return inst

    def stop_accepting(self, worker_id: str) -> tuple[PartialOutput, ...]:
        """Drain: no new requests; its queued ones come back to be routed elsewhere."""
        self.accepting.discard(worker_id)
        inst = self.instances.get(worker_id)
        return inst.engine.drain() if inst else ()

    def remove(self, worker_id: str) -> tuple[PartialOutput, ...]:
        """The instance leaves; every request on it comes back with its partial output."""
        self.accepting.discard(worker_id)
        inst = self.instances.pop(worker_id, None)
        if inst is None:
            return ()
        return inst.engine.abort_all()

    def accepts(self, inst: Instance) -> bool:
        """The instance is still in the fleet (not one that left under the same worker id,
        as a switch does) and takes requests."""
        return self.instances.get(inst.worker_id) is inst and inst.worker_id in self.accepting

    def entry_ids(self) -> list[str]:
        """Accepting instances a new turn may start on."""
        has_decode = any(self.instances[w].role is Role.DECODE for w in self.accepting)
        return [
            w
            for w in self.accepting
            if self.instances[w].role is Role.COLOCATED
            or (self.instances[w].role is Role.PREFILL and has_decode)
        ]

    # --- routing -------------------------------------------------------------------------

    def route(self, request: Request) -> Instance | None:
        """The instance a turn goes to (affinity first), or None: park it."""
        wid = self.affinity.get(request.traj_id)
        if wid in self.accepting:
            inst = self.instances[wid]
            if inst.role is not Role.DECODE and inst.engine.num_waiting == 0:
                return inst
        entries = self.entry_ids()
        if not entries:
            return None
        best = min(entries, key=lambda w: (self.instances[w].load, w))
        self.affinity[request.traj_id] = best
        return self.instances[best]

    def route_decode(self) -> Instance | None:
        decodes = [w for w in self.accepting if self.instances[w].role is Role.DECODE]
        if not decodes:
            return None
        return self.instances[min(decodes, key=lambda w: (self.instances[w].load, w))]

    def expect(self, inst: Instance, request_id: str, arrival_s: float) -> None:
        """A request will reach ``inst`` at ``arrival_s``: bound its multi-step runs."""
        heapq.heappush(inst.due, (arrival_s, request_id))
        inst.num_assigned += 1

    def arrive(self, inst: Instance) -> None:
        inst.num_assigned -= 1

    # --- steps ---------------------------------------------------------------------------

    def start_step(self, inst: Instance, now_s: float, horizon_s: float) -> float | None:
        """Start the instance's next step if it is idle and has work; its end time."""
        if inst.busy_until_s is not None or not inst.engine.has_work:
            return None
        start_s = max(now_s, inst.paused_until_s)
        if start_s > now_s:
            return None  # the caller wakes it at paused_until_s
        bound_s = min(inst.next_due_s(now_s), horizon_s) - now_s
        result = inst.engine.step(MAX_STEPS_PER_CALL, max(bound_s, 0.0))
        inst.result = result
        inst.step_started_s = now_s
        inst.busy_until_s = now_s + result.duration_s
        return inst.busy_until_s

    def end_step(self, inst: Instance) -> EngineStepResult:
        result = inst.result
        assert result is not None and inst.busy_until_s is not None
        inst.result, inst.busy_until_s = None, None
        return result


def handoff_request(h: KvHandoff, request_id: str) -> Request:
    """The decode half of a turn whose prompt a prefill instance computed."""
    r = h.request
    return Request(request_id, r.traj_id, r.context_tokens, r.output_tokens, h.kv_tokens)
