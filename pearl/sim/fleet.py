"""The inference instances of a simulated run and the router in front of them.

Each instance wraps one ``EngineModel`` (per request, per scheduler step) and runs one
step at a time on the simulator's clock: ``start_step`` runs an idle instance's next
step (the engine computes it at once), the caller schedules the step's end, and
``end_step`` hands over its results (finished turns, KV handoffs). Nothing here keeps a
clock or a heap.

Routing is ``pearl.serving.routing``'s (its docstring states the rules): the fleet hands
the rules its instances as the router's views (an ``Instance`` is an ``InstanceLoad``; the
``Candidates`` are kept until an instance joins, leaves or stops accepting, and their
least loaded in a ``pearl.serving.load_index.CandidateLoads`` that every change of a load
is reported to) and builds the ``InstanceQueue`` of the few a turn's cost is weighed on.
A turn stays on the instance of its trajectory's previous turn (its *home*, where its
prefix is cached) unless it is expected to finish sooner on the least-loaded entry
instance (colocated, or prefill when decode instances exist to take the KV), recomputing
the prefix there. A prefill
instance's handoff goes to the least-loaded decode instance after the KV transfer. With
no entry instance with room (every one starting, switching, gone or full: holding as
many requests as it runs at once) a turn is parked, and routed again once one has room.

The views are what a router knows: the home and the prefix the router left there (the
prompt it last sent, and the output when the instance also decoded it; an instance that
left, or a new one under the same worker id, is no home), each instance's requests
running, waiting and in flight to it, its queued prefill work and decoding batch
(``EngineModel.queued_prefill``), and the mean output of the requests finished so far
(``expected_output_tokens``; the profile's mean until one has). A turn is routed when it
is sent (at the start of its tool call, so that the instance can stop its multi-step run
when the turn arrives), on the views of that moment.

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
from functools import partial

from pearl.core.profile import EngineProfile, RuntimeProfile, WorkloadDefaults
from pearl.core.roles import Role
from pearl.serving import routing
from pearl.serving.load_index import CandidateLoads
from pearl.serving.requests import PartialOutput, Request
from pearl.serving.views import InstanceLoad, InstanceQueue
from pearl.sim.engine import EngineStepResult, KvHandoff
from pearl.sim.engine_models import EngineModelName, InstanceEngine, make_engine

MAX_STEPS_PER_CALL = 4096


@dataclass
class Instance:
    worker_id: str
    role: Role
    gpu_type: str
    node: str
    tp: int
    engine: InstanceEngine
    weights_version: int
    slots: int  # requests it runs at once (``InstanceLoad.slots``: its max_num_seqs)
    kv_slots: int  # the workload's contexts its KV holds (``InstanceLoad.kv_slots``)
    turn_s: float  # busy time per turn of the workload's mean shape (``InstanceLoad.turn_s``)
    busy_until_s: float | None = None  # end of the step in flight
    step_started_s: float = 0.0
    result: EngineStepResult | None = None
    paused_until_s: float = 0.0  # e.g. loading new weights
    due: list[tuple[float, str]] = field(default_factory=list)  # (arrival time, request id)
    num_assigned: int = 0  # requests in flight to it (tool call or KV transfer)
    accepting: bool = True  # takes new requests (False once draining or removed)

    @property
    def load(self) -> int:
        """Requests running, waiting and in flight to it (``InstanceLoad.load``)."""
        return self.engine.num_requests + self.num_assigned

    def next_due_s(self, now_s: float) -> float:
        while self.due and self.due[0][0] < now_s:
            heapq.heappop(self.due)
        return self.due[0][0] if self.due else math.inf


@dataclass(frozen=True, slots=True)
class Home:
    """Where the router last sent a trajectory, and the prefix it left cached there."""

    instance: Instance
    prefix_tokens: int  # the prompt it sent, with the output if that instance decoded it


class Fleet:
    """Instances by worker id, each trajectory's home, parked requests."""

    def __init__(
        self,
        profile: RuntimeProfile,
        engine_model: EngineModelName = "step",
        workload: WorkloadDefaults | None = None,
    ) -> None:
        self.profile = profile
        self.engine_model: EngineModelName = engine_model
        # the workload's mean shape (the profile's defaults unless given), for each
        # instance's kv_slots (a typical context: routing.kv_slots) and turn_s
        # (routing.turn_work_s)
        self.workload = workload if workload is not None else profile.workload
        self.context_tokens = routing.mean_context_tokens(self.workload)
        self.instances: dict[str, Instance] = {}
        self.affinity: dict[str, Home] = {}  # traj id -> instance of its last turn
        self.parked: list[Request] = []
        self._engines: frozenset[EngineProfile] | None = None
        self._candidates: routing.Candidates | None = None  # until membership changes
        self._loads: CandidateLoads | None = None  # their least loaded, kept as loads change
        self._load_changes: list[InstanceLoad] = []  # loads changed since the last route
        # the output tokens of the requests finished so far (the router's observation)
        self.finished_requests = 0
        self.finished_output_tokens = 0

    # --- membership --------------------------------------------------------------------

    def add(
        self, worker_id: str, role: Role, gpu_type: str, node: str, tp: int, version: int
    ) -> Instance:
        engine = make_engine(self.engine_model, role, self.profile, gpu_type, tp)
        kv = routing.kv_slots(self.profile.kv_capacity_tokens(gpu_type, tp), self.context_tokens)
        slots = engine.engine.max_num_seqs
        turn_s = routing.turn_work_s(engine.engine, role, self.workload, kv)
        inst = Instance(worker_id, role, gpu_type, node, tp, engine, version, slots, kv, turn_s)
        engine.on_requests_changed = partial(self._load_changes.append, inst)
        self.instances[worker_id] = inst
        self._engines = self._candidates = self._loads = None
        return inst

    def stop_accepting(self, worker_id: str) -> tuple[PartialOutput, ...]:
        """Drain: no new requests; its queued ones come back to be routed elsewhere."""
        inst = self.instances.get(worker_id)
        if inst is None:
            return ()
        inst.accepting = False
        self._candidates = self._loads = None
        return inst.engine.drain()

    def remove(self, worker_id: str) -> tuple[PartialOutput, ...]:
        """The instance leaves; every request on it comes back with its partial output."""
        inst = self.instances.pop(worker_id, None)
        if inst is None:
            return ()
        inst.accepting = False
        self._candidates = self._loads = None
        return inst.engine.abort_all()

    def accepts(self, inst: Instance) -> bool:
        """The instance is still in the fleet (not one that left under the same worker id,
        as a switch does) and takes requests."""
        return inst.accepting and self.instances.get(inst.worker_id) is inst

    def candidates(self) -> routing.Candidates:
        """The accepting instances by what they may take (kept until membership changes)."""
        if self._candidates is None:
            self._candidates = routing.candidates(self.instances.values())
        return self._candidates

    def loads(self) -> CandidateLoads:
        """The candidates' least-loaded entry and decode instance (``routing.LoadOrder``),
        kept as their loads change: every change of an instance's load (``Instance.load``)
        is appended to its list of changes, by the engine (``EngineModel.on_requests_changed``)
        and by ``expect`` and ``arrive``."""
        if self._loads is None:
            cands = self.candidates()
            self._loads = CandidateLoads(cands.entries, cands.decodes, self._load_changes)
        return self._loads

    def entry_ids(self) -> list[str]:
        """Accepting instances a new turn may start on."""
        return [v.worker_id for v in self.candidates().entries]

    # --- routing -------------------------------------------------------------------------

    def queue(self, worker_id: str) -> InstanceQueue:
        """The router's view of the work ahead on one instance."""
        inst = self.instances[worker_id]
        engine = inst.engine
        tokens, pairs = engine.queued_prefill()
        return InstanceQueue(
            engine.engine,
            tokens,
            pairs,
            engine.num_decoding,
            engine.decoding_context_tokens,
            inst.load,
        )

    @property
    def expected_output_tokens(self) -> float:
        """The mean output of the requests finished so far (of a turn, or of what was left
        of it), the profile's mean output per turn until one has."""
        if self.finished_requests == 0:
            return self.profile.workload.output_tokens_per_turn
        return self.finished_output_tokens / self.finished_requests

    def engines(self) -> frozenset[EngineProfile]:
        """The engine profiles of the instances (kept until an instance joins)."""
        if self._engines is None:
            self._engines = frozenset(inst.engine.engine for inst in self.instances.values())
        return self._engines

    def route(self, request: Request) -> Instance | None:
        """The instance a turn goes to (``routing.route_turn``), or None: park it."""
        home = self.affinity.get(request.traj_id)
        if home is not None and not self.accepts(home.instance):
            home = None  # it left, or stopped accepting: no home
        wid = routing.route_turn(
            request.context_tokens,
            self.expected_output_tokens,
            self.candidates(),
            home.instance if home is not None else None,
            home.prefix_tokens if home is not None else 0,
            self.queue,
            self.engines(),
            self.loads(),
        )
        if wid is None:
            return None
        inst = self.instances[wid]
        prefix = request.context_tokens
        if inst.role is Role.COLOCATED:
            prefix += request.output_tokens
        self.affinity[request.traj_id] = Home(inst, prefix)
        return inst

    def route_decode(self) -> Instance | None:
        """The decode instance a prefill's KV goes to (``routing.route_decode``), or None."""
        wid = routing.route_decode(self.candidates(), self.loads())
        return self.instances[wid] if wid is not None else None

    def expect(self, inst: Instance, request_id: str, arrival_s: float) -> None:
        """A request will reach ``inst`` at ``arrival_s``: bound its multi-step runs."""
        heapq.heappush(inst.due, (arrival_s, request_id))
        inst.num_assigned += 1
        self._load_changes.append(inst)

    def arrive(self, inst: Instance) -> None:
        inst.num_assigned -= 1
        self._load_changes.append(inst)

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
        for f in result.finished:
            self.finished_requests += 1
            self.finished_output_tokens += f.request.output_tokens
        return result


def handoff_request(h: KvHandoff, request_id: str) -> Request:
    """The decode half of a turn whose prompt a prefill instance computed."""
    r = h.request
    return Request(request_id, r.traj_id, r.context_tokens, r.output_tokens, h.kv_tokens)
