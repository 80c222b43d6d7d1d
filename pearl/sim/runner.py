"""One simulated run: the event loop that drives ``pearl.core.decide()`` on a virtual clock.

The same decision code as the coordinator's runs here; the simulator plays everything
around it: the engines (``fleet``), the trajectories (``rollout``), Slurm (``slurm``,
``allocations``), the trainer, and the execution of transition plans step by step
(``execution``).

Loop (each event returns its follow-ups; ties break by priority, then schedule order):

- an engine step ends: finished turns go to their tool call (or finish the trajectory),
  prefill handoffs travel to a decode instance, the instance starts its next step;
- a turn arrives at its instance after its tool call or KV transfer;
- Slurm grants, warns (preempting) or reclaims an elastic allocation; a reclaimed node's
  engines are killed and their requests continue elsewhere with their partial outputs;
- the trainer starts an update when its next batch is complete and it holds all its
  GPUs, and after it the new weights are synced to every instance (each pauses
  ``weight_sync_s``) and the next batch may start (staleness bound k);
- a decision: the policy's ``decide()`` on the observed state. Decisions are taken at
  the start, every ``decision_interval_s``, and at once on any allocation event and any
  change of the trainer's phase; while a plan runs they wait for its end (one plan at a
  time, as the coordinator executes them). Causes at one time with nothing handled
  between them get one decision.

Engine calls never run past the next control event (a plan step, a Slurm event, the
end of an update, a decision; ``horizon_s``), except for the one step a call always
runs: an instance taken off or paused has finished its step in flight by then, up to
that one step.

Determinism: one generator per concern (trajectories, Slurm), built from
``RunInputs.seed``; no wall clock. Same inputs, same run, bit for bit.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pearl.core.decide import decide
from pearl.core.decision import ElasticRequest
from pearl.core.execution import AllocationIds, Executor, PlanEnd, PlanOutcome
from pearl.core.observation import (
    Observation,
    TrainerPhase,
    TrainerStatus,
)
from pearl.core.plan import TransitionPlan
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import GpuSource
from pearl.core.state import ClusterState
from pearl.core.workload import TrajPhase
from pearl.runlog.records import (
    BorrowRecords,
    batch_consumed_record,
    decision_record,
    past_bound_record,
    state_records,
)
from pearl.runlog.schema import (
    BatchCompleted,
    BorrowChanged,
    Record,
    RunEnded,
    RunStarted,
    TrainStep,
    TrajectoryFinished,
)
from pearl.serving.requests import PartialOutput, Request
from pearl.serving.views import full
from pearl.sim.allocations import ElasticAllocations
from pearl.sim.availability import Window
from pearl.sim.baselines import SimPolicy
from pearl.sim.engine import KvHandoff, kv_transfer_s
from pearl.sim.events import EventLoop
from pearl.sim.execution import PlanExecution
from pearl.sim.fleet import Fleet, Instance, handoff_request
from pearl.sim.metrics import GpuClock, RunMetrics, rollout_figures
from pearl.sim.predictions import PredictionLedger
from pearl.sim.rollout import BatchRecord, Rollout, Trajectory, trajectory_stream
from pearl.sim.scenario import Scenario
from pearl.sim.slurm import SlurmModel
from pearl.sim.states import initial_state, synced
from pearl.sim.timeline import (
    Arrive,
    Decide,
    Eligible,
    Follow,
    Kick,
    PlanStepEnds,
    PlanStepStarts,
    SimEvent,
    SlurmChange,
    StartTrajectories,
    StepEnds,
    TrainDone,
    Unpark,
)
from pearl.sim.trajectories import TrajectoryModel, TrajectorySpec, means, turns_left_table

Sink = Callable[[Record], None]
Queued = list[tuple[float, SimEvent, int]]  # follow-ups with their priority, for the loop


@dataclass(frozen=True)
class RunInputs:
    scenario: Scenario
    profile: RuntimeProfile
    trajectory_model: TrajectoryModel
    windows: tuple[Window, ...]  # elastic availability in run time (already clipped)
    seed: int
    decision_interval_s: float = 60.0

    def stream(self) -> Iterator[TrajectorySpec]:
        """The run's trajectory stream from its first trajectory: what its rollout draws,
        and what the oracle and the checks draw to see the same trajectories."""
        rollout = self.scenario.rollout
        return trajectory_stream(
            self.trajectory_model,
            trajectory_rng(self.seed),
            rollout.max_context_tokens,
            rollout.group_size,
        )


def trajectory_rng(seed: int) -> np.random.Generator:
    """The generator of a run's trajectory stream (the oracle draws the same stream)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[0])


def restart_rng(seed: int) -> np.random.Generator:
    """The generator of restarted trajectories' fresh samples (never the shared stream)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])


class Simulation:
    def __init__(self, inputs: RunInputs, policy: SimPolicy, sink: Sink | None = None) -> None:
        sc = inputs.scenario
        self.inputs, self.policy, self.profile = inputs, policy, inputs.profile
        self.sink = sink
        self.duration_s = sc.duration_s
        self.rollout = Rollout(
            inputs.trajectory_model,
            trajectory_rng(inputs.seed),
            restart_rng(inputs.seed),
            sc.rollout.rules(),
            sc.rollout.max_context_tokens,
            means(inputs.trajectory_model).env_latency_s,
        )
        self.turns_left = turns_left_table(inputs.trajectory_model)
        el = sc.elastic
        slurm = SlurmModel.from_windows(
            inputs.windows,
            queue_delay_median_s=el.queue_delay_median_s,
            queue_delay_sigma=el.queue_delay_sigma,
            grace_s=el.grace_s,
            rng=np.random.default_rng(np.random.SeedSequence(inputs.seed).spawn(3)[1]),
        )
        self.elastic = ElasticAllocations(slurm, self.take_off_nodes, self.log)
        self.loop: EventLoop[SimEvent] = EventLoop()
        self.fleet = Fleet(self.profile, sc.engine_model, means(inputs.trajectory_model))
        self.state: ClusterState = initial_state(sc)
        self.logged_state: ClusterState | None = None
        self.version = sc.rollout.initial_policy_version
        step_s = sc.training.train_step_s
        self.train_step_s = step_s if step_s is not None else self.profile.costs.train_step_s
        self.trainer_gpus = sum(1 for g in self.state.gpus if g.source is GpuSource.BASE_TRAIN)
        self.trainer_present = self.trainer_gpus
        self.training = False
        self.needs_since_s: float | None = None
        self.train_started_s = 0.0
        self.executor = Executor(self, AllocationIds())
        self.plan: PlanExecution | None = None
        self._effects: Follow = []  # follow-ups of the executor's calls of this world
        self.decide_after_plan = False
        self.next_decision_s = 0.0
        self.handled = 0  # events handled other than decisions (see _on_decide)
        self.decided_at: tuple[float, int] | None = None  # (time, handled) of the last one
        self.control_times: list[float] = []  # heap: see horizon_s
        self.lent_clock = GpuClock()
        self.max_wait_s = 0.0
        self.train_steps = 0
        self.transitions = 0
        self.decisions = 0
        self.ledger = PredictionLedger()
        self.staleness: list[int] = []  # of each consumed batch, its stalest trajectory
        self.borrows = BorrowRecords()
        self.handlers: dict[type[SimEvent], Callable[[Any, float], Follow]] = {
            StartTrajectories: lambda _, now_s: self._start_trajectories(now_s),
            StepEnds: self._on_step,
            Arrive: self._on_arrive,
            Kick: self._on_kick,
            Unpark: lambda _, now_s: self.unpark(now_s),
            SlurmChange: self.elastic.on_slurm,
            Eligible: lambda _, now_s: self.elastic.on_eligible(now_s),
            PlanStepStarts: self._on_plan_step_start,
            PlanStepEnds: self._on_plan_step_end,
            TrainDone: self._on_train_done,
            Decide: self._on_decide,
        }

    # --- the run -----------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> RunMetrics:
        sc = self.inputs.scenario
        self.log(
            RunStarted.model_construct(
                t=0.0,
                run_id=f"{sc.name}-{self.policy.name}-{self.inputs.seed}",
                source="simulator",
                policy=self.policy.name,
                scenario=sc.name,
                seed=self.inputs.seed,
                profile=sc.profile,
                max_return_delay_s=self.policy.config().borrowing.max_return_delay_s,
            )
        )
        for t in self.elastic.retry_times(self.duration_s):
            self.loop.schedule(t, Eligible(), Eligible.PRIORITY)
        self.loop.schedule(0.0, StartTrajectories(), StartTrajectories.PRIORITY)
        self.loop.schedule(0.0, Decide("start"), Decide.PRIORITY)
        step_s = self.duration_s / 100
        t = 0.0
        while t < self.duration_s:
            t = min(t + step_s, self.duration_s)
            self.loop.run(self._handle, until_s=t)
            if progress is not None:
                progress(t / self.duration_s)
        self.log(RunEnded.model_construct(t=self.duration_s, reason="duration reached"))
        return self._metrics()

    def _handle(self, event: SimEvent, now_s: float) -> Queued:
        if type(event) is not Decide:
            self.handled += 1
        out = self.handlers[type(event)](event, now_s)
        for time_s, ev in out:
            if ev.CONTROL:
                heapq.heappush(self.control_times, time_s)
        return [(time_s, ev, ev.PRIORITY) for time_s, ev in out]

    def horizon_s(self, now_s: float) -> float:
        """The next time anything may take an instance off, pause it or change its
        weights: a step in flight must not run past it (engine calls stop there)."""
        times = self.control_times
        while times and times[0] < now_s:
            heapq.heappop(times)
        return times[0] if times else math.inf

    def log(self, record: Record) -> None:
        if self.sink is not None:
            self.sink(record)

    def log_state(self, now_s: float) -> None:
        """The GPUs, workers and allocations that changed since the last logged state
        (at each decision and at the end of each plan: roles at plan granularity; the
        plan's steps are logged as they end)."""
        if self.sink is not None:
            for record in state_records(self.logged_state, self.state, now_s, allocations=False):
                self.sink(record)
            self.logged_state = self.state

    # --- engines -------------------------------------------------------------------------

    def _kick(self, inst: Instance, now_s: float) -> Follow:
        end_s = self.fleet.start_step(inst, now_s, self.horizon_s(now_s))
        if end_s is None:
            return []
        return [(end_s, StepEnds(inst))]

    def _on_kick(self, ev: Kick, now_s: float) -> Follow:
        inst = ev.instance
        if self.fleet.instances.get(inst.worker_id) is not inst:
            return []
        return self._kick(inst, now_s)

    def _on_step(self, ev: StepEnds, now_s: float) -> Follow:
        inst = ev.instance
        if self.fleet.instances.get(inst.worker_id) is not inst or inst.busy_until_s != now_s:
            return []  # the instance was removed mid-step
        return self._step_outcome(inst) + self._kick(inst, now_s) + self._unpark_if_room(now_s)

    def _unpark_if_room(self, now_s: float) -> Follow:
        """Parked turns go once some entry instance has room again (a request left one: a
        step ended, a request in flight to it turned out stale, an update aborted some)."""
        if not self.fleet.parked:
            return []
        least = self.fleet.loads().least_loaded_entry()
        if least is None or full(least):
            return []
        return self.unpark(now_s, until_parked_again=True)

    def _step_outcome(self, inst: Instance, until_s: float = math.inf) -> Follow:
        """The finished turns and prefill handoffs of the instance's step in flight, at
        their times in the step but no later than ``until_s``."""
        start_s = inst.step_started_s
        result = self.fleet.end_step(inst)
        out: Follow = []
        for h in result.handoffs:
            traj = self._live(h.request)
            if traj is not None:
                ready_s = min(start_s + h.ready_offset_s, until_s)
                out += self._send_handoff(traj, h, inst, ready_s)
        for f in result.finished:
            traj = self._live(f.request)
            if traj is not None:
                done_s = min(start_s + f.finish_offset_s, until_s)
                out += self._turn_done(traj, done_s, inst.weights_version)
        return out

    def _live(self, request: Request) -> Trajectory | None:
        """The request's trajectory, if the request is still its live one (a restart or a
        drop at an update leaves the old request's events stale)."""
        traj = self.rollout.in_flight.get(request.traj_id)
        return traj if traj is not None and traj.request_id == request.request_id else None

    def take_off_nodes(self, nodes: set[str], now_s: float) -> Follow:
        out: Follow = []
        for wid, inst in list(self.fleet.instances.items()):
            if inst.node in nodes:
                out += self.take_off(wid, now_s)
        return out

    def take_off(self, worker_id: str, now_s: float) -> Follow:
        """The instance leaves the fleet. Its step in flight completes now (the engine has
        already retired what it finishes: dropping it would lose those turns; a step runs
        past a control event only when it is a call's one step, so a turn ends at most
        that step early, and the log stays in time order), and every request left on it
        continues elsewhere with the tokens it generated."""
        inst = self.fleet.instances.get(worker_id)
        if inst is None:
            return []
        out = self._step_outcome(inst, now_s) if inst.busy_until_s is not None else []
        return out + self.resubmit(self.fleet.remove(worker_id), now_s, inst.weights_version)

    def _send_handoff(
        self, traj: Trajectory, h: KvHandoff, src: Instance, ready_s: float
    ) -> Follow:
        dst = self.fleet.route_decode()
        if dst is None:  # no decode instance any more: the turn starts over
            return self._submit(traj, ready_s)
        req = handoff_request(h, traj.next_request().request_id)
        tp = min(src.tp, dst.tp)
        arrive_s = ready_s + kv_transfer_s(
            h.kv_tokens, self.profile, src.gpu_type, src.node == dst.node, tp
        )
        self.fleet.expect(dst, req.request_id, arrive_s)
        return [(max(arrive_s, self.loop.now_s), Arrive(req, dst))]

    def _turn_done(self, traj: Trajectory, at_s: float, version: int) -> Follow:
        at_s = max(at_s, self.loop.now_s)
        tool_end_s = self.rollout.finish_turn(traj, at_s, version)
        if tool_end_s is not None:
            return self._submit(traj, tool_end_s)
        batch = self.rollout.finish(traj, at_s)
        if self.sink is not None:  # a record per trajectory: not built for no log
            self._log_finished(traj, at_s)
        if self.rollout.in_order:
            first = next(iter(self.rollout.in_flight.values()), None)
            self.ledger.finished_below(at_s, first.index if first else self.rollout.num_started)
        out = self._batch_complete(batch, at_s)
        if self.rollout.rules.max_in_flight is not None:  # a running slot is free again
            out += self._start_trajectories(at_s)
        return out

    def _log_finished(self, traj: Trajectory, at_s: float) -> None:
        min_version = self.rollout.ledger.trajectories[traj.traj_id].min_version
        assert min_version is not None, "a finished turn generated a token"
        self.log(
            TrajectoryFinished.model_construct(
                t=at_s,
                traj_id=traj.traj_id,
                batch_id=traj.index // self.rollout.rules.batch_trajectories
                if self.rollout.in_order
                else None,
                num_turns=traj.spec.num_turns,
                output_tokens=sum(traj.spec.output_tokens),
                min_policy_version=min_version,
            )
        )

    def _batch_complete(self, batch: BatchRecord | None, now_s: float) -> Follow:
        """The next batch has just become complete (``batch``), or nothing happened."""
        if batch is None:
            return []
        self.log(
            BatchCompleted.model_construct(
                t=now_s,
                batch_id=batch.batch_id,
                started_t=batch.started_s or 0.0,
                predicted_s=batch.predicted_s,
            )
        )
        if not self.rollout.in_order:
            self.ledger.batch_ready(now_s)
        return self._maybe_train(now_s)

    def _submit(self, traj: Trajectory, at_s: float) -> Follow:
        """Send the trajectory's current turn (what is left of it) to an instance at ``at_s``."""
        req = traj.next_request()
        inst = self.fleet.route(req)
        if inst is not None:
            self.fleet.expect(inst, req.request_id, at_s)
        return [(max(at_s, self.loop.now_s), Arrive(req, inst))]

    def _on_arrive(self, ev: Arrive, now_s: float) -> Follow:
        return self._arrive(ev.request, ev.instance, now_s)

    def _arrive(self, req: Request, inst: Instance | None, now_s: float) -> Follow:
        if inst is not None:
            self.fleet.arrive(inst)
        traj = self._live(req)
        if traj is None:  # gone while on its way (an update took it back): its slot frees
            return self._unpark_if_room(now_s) if inst is not None else []
        self.rollout.sent(traj)
        if inst is None or not self.fleet.accepts(inst):
            if req.kv_ready_tokens:  # its KV went to an instance that left: start over
                return self._submit(traj, now_s)
            inst = self.fleet.route(req)
            if inst is None:
                self.fleet.parked.append(req)
                return []
        inst.engine.submit(req)
        traj.phase = TrajPhase.QUEUED
        return self._kick(inst, now_s)

    def resubmit(self, partials: Iterable[PartialOutput], now_s: float, version: int) -> Follow:
        """Requests taken off an instance continue elsewhere with what they generated."""
        out: Follow = []
        for p in partials:
            traj = self._live(p.request)
            assert traj is not None, "stale requests are aborted at once"
            self.rollout.turn_generated(traj, p.num_generated_tokens, version)
            out += self._submit(traj, now_s)
        return out

    def unpark(self, now_s: float, until_parked_again: bool = False) -> Follow:
        """The parked turns routed again, in the order they parked. ``until_parked_again``
        (a request left an instance, so there is room for a few): the first that parks
        again keeps the rest parked, as every entry is full then (a turn parks only when
        its home, if any, and the least-loaded entry are: the least loaded full, all are)."""
        parked, self.fleet.parked = self.fleet.parked, []
        out: Follow = []
        for i, req in enumerate(parked):
            out += self._arrive(req, None, now_s)
            if until_parked_again and self.fleet.parked:
                self.fleet.parked += parked[i + 1 :]
                break
        return out

    # --- trajectories and the trainer ----------------------------------------------------

    def _start_trajectories(self, now_s: float) -> Follow:
        out: Follow = []
        for _ in range(self.rollout.startable() // self.rollout.rules.group_size):
            for traj in self.rollout.start_group(now_s):
                out += self._submit(traj, now_s)
        return out

    def _maybe_train(self, now_s: float) -> Follow:
        if self.training or not self.rollout.ledger.batch_ready():
            return []
        if self.trainer_present < self.trainer_gpus:
            if self.needs_since_s is None:
                self.needs_since_s = now_s
                return [(now_s, Decide("trainer needs its GPUs"))]
            return []
        waited_s = 0.0 if self.needs_since_s is None else now_s - self.needs_since_s
        self.max_wait_s = max(self.max_wait_s, waited_s)
        self.policy.on_train_step(waited_s)
        self.needs_since_s = None
        self.training = True
        self.train_started_s = now_s
        batch = self.rollout.take_batch(now_s)
        self.log(batch_consumed_record(now_s, batch))
        self.staleness.append(batch.max_staleness_versions)
        out: Follow = [
            (now_s + self.train_step_s, TrainDone(now_s, waited_s)),
            (now_s, Decide("trainer started an update")),
        ]
        return out + self._batch_complete(self.rollout.completed(now_s), now_s)

    def _on_train_done(self, ev: TrainDone, now_s: float) -> Follow:
        started_s, waited_s = ev.started_s, ev.waited_s
        self.training = False
        self.log(
            TrainStep.model_construct(
                t=now_s,
                step=self.train_steps,
                started_t=started_s,
                policy_version=self.version + 1,
                waited_for_gpus_s=waited_s,
            )
        )
        self.train_steps += 1
        self.version += 1
        self.state = synced(self.state, self.version)
        out: Follow = []
        if self.inputs.scenario.training.weight_sync_every_update:
            sync_s = self.profile.costs.weight_sync_s
            pause_s = now_s + sync_s
            for inst in self.fleet.instances.values():
                self.load_weights(inst)
                inst.paused_until_s = max(pause_s, (inst.busy_until_s or now_s) + sync_s)
                out.append((inst.paused_until_s, Kick(inst)))
        out += self._past_bound(now_s)
        out += self._start_trajectories(now_s)
        out += self._maybe_train(now_s)
        out.append((now_s, Decide("trainer waiting")))
        return out

    def load_weights(self, inst: Instance) -> None:
        """The instance takes the trainer's weights. The tokens its live requests generated
        so far are its old weights': those on its engine and those its step in flight
        finishes (``pearl.sim.execution.PlanHost``)."""
        done = inst.result.finished if inst.result is not None else ()
        on_engine = inst.engine.generated_by_request()
        for request, num_tokens in [
            *on_engine,
            *((f.request, f.request.output_tokens) for f in done),
        ]:
            traj = self._live(request)
            if traj is not None and num_tokens:
                self.rollout.attribute_on_engine(traj, num_tokens, inst.weights_version)
        inst.weights_version = self.version

    def _past_bound(self, now_s: float) -> Follow:
        """The update's past-bound rule: abort what it restarts or drops, resend restarts."""
        outcome, stale = self.rollout.updated(now_s, self.version)
        if outcome.empty:
            return []
        self.log(past_bound_record(now_s, outcome, self.rollout.rules.past_bound))
        gone = set(stale)
        for inst in self.fleet.instances.values():
            for request_id in inst.engine.request_ids() & gone:
                inst.engine.abort(request_id)
        self.fleet.parked = [r for r in self.fleet.parked if r.request_id not in gone]
        out: Follow = []
        for traj_id in outcome.restarted:
            out += self._submit(self.rollout.in_flight[traj_id], now_s)
        out += self._unpark_if_room(now_s)  # the aborted requests' slots
        return out + self._batch_complete(self.rollout.completed(now_s), now_s)

    def trainer_gpus_changed(self, now_s: float, delta: int) -> Follow:
        self.trainer_present += delta
        self.lent_clock.add(now_s, -delta)
        if delta > 0 and self.trainer_present == self.trainer_gpus:
            window = self.state.borrow
            gpu_ids = window.gpu_ids if window is not None else ()
            self.log(BorrowChanged.model_construct(t=now_s, kind="returned", gpu_ids=gpu_ids))
        return self._maybe_train(now_s) if delta > 0 else []

    # --- decisions and plans -------------------------------------------------------------

    def _on_decide(self, ev: Decide, now_s: float) -> Follow:
        out: Follow = []
        if ev.why == "tick" and now_s < self.next_decision_s:
            return []
        if self.decided_at == (now_s, self.handled):  # several causes at one time:
            return []  # nothing has happened since the decision they all asked for
        if self.executor.plan_running:
            self.decide_after_plan = True
            return []
        self.next_decision_s = now_s + self.inputs.decision_interval_s
        out.append((self.next_decision_s, Decide("tick")))
        obs = Observation(
            events=self.elastic.take_events(),
            trainer=TrainerStatus(
                phase=TrainerPhase.TRAINING if self.training else TrainerPhase.WAITING,
                needs_gpus=self.needs_since_s is not None,
            ),
            workload=self.rollout.snapshot(
                now_s, self._version_soon(), self.turns_left, self._update_left_s(now_s)
            ),
        )
        cfg = self.policy.config(bootstrap=self.decisions == 0)
        decision = decide(self.state, obs, cfg, self.profile, now_s)
        self.decisions += 1
        self.decided_at = (now_s, self.handled)
        self.state = decision.state
        self.log_state(now_s)
        self._note_prediction(now_s, obs.workload.num_unfinished, decision.predicted_s)
        if self.sink is not None:
            self.log(decision_record(now_s, self.policy.name, decision))
            borrow = self.borrows.record(now_s, decision)
            if borrow is not None:
                self.log(borrow)
        self.executor.carry_out(decision, now_s)  # a plan runs on: its last step ends it
        return out + self._take_effects()

    # --- the world of the core's executor (pearl.core.execution.World) -------------------

    def submit(self, allocation_id: str, request: ElasticRequest, now_s: float) -> None:
        self._effects += self.elastic.request(
            allocation_id, request.gpu_type, request.num_gpus, now_s
        )

    def release(self, allocation_id: str, now_s: float) -> None:
        self._effects += self.elastic.release(allocation_id, now_s)

    def run_plan(self, plan: TransitionPlan, now_s: float) -> None:
        self.transitions += 1
        self.plan = PlanExecution(self, plan, now_s)
        self._effects += self.plan.begin()  # the last step's end calls plan_ended

    def adopt(self, end: PlanEnd, now_s: float) -> None:
        state = end.state
        if self.version > state.policy_version:  # an update finished during the plan
            state = synced(state, self.version)
        self.state = state
        self.log_state(now_s)

    def _take_effects(self) -> Follow:
        effects, self._effects = self._effects, []
        return effects

    @property
    def dead_nodes(self) -> set[str]:
        return self.elastic.dead_nodes

    def _on_plan_step_start(self, ev: PlanStepStarts, now_s: float) -> Follow:
        assert self.plan is not None
        return self.plan.on_start(ev.index, now_s)

    def _on_plan_step_end(self, ev: PlanStepEnds, now_s: float) -> Follow:
        plan = self.plan
        assert plan is not None
        out = plan.on_end(ev.index, now_s)
        if not plan.done:
            return out
        self.plan = None
        self.executor.plan_ended(PlanOutcome.all_of(plan.plan), now_s)
        out += self._take_effects()  # the releases that follow the plan
        out += self._maybe_train(now_s)
        if self.decide_after_plan:
            self.decide_after_plan = False
            out.append((now_s, Decide("after plan")))
        return out

    def _update_left_s(self, now_s: float) -> float:
        """Until the running update ends (0 when none runs), as its start and the step
        time tell a coordinator."""
        if not self.training:
            return 0.0
        return max(self.train_started_s + self.train_step_s - now_s, 0.0)

    def _version_soon(self) -> int:
        """The weights' version once a running update ends: the batch it unlocks is about
        to start, and its load is part of what the engines face (a coordinator knows the
        update's end time)."""
        return self.version + 1 if self.training else self.version

    def _note_prediction(self, now_s: float, num_unfinished: int, predicted_s: float) -> None:
        if not num_unfinished or not math.isfinite(predicted_s):
            return
        if not self.rollout.in_order:
            if not self.rollout.ledger.batch_ready():
                self.ledger.note_batch(now_s, predicted_s)
        else:
            last = self.rollout.num_started + self.rollout.startable(self._version_soon()) - 1
            self.ledger.note(now_s, last, predicted_s)
        for batch in self.rollout.batches.values():  # its duration, as first predicted
            if batch.predicted_s is None and batch.started_s is not None:
                batch.predicted_s = now_s + predicted_s - batch.started_s

    # --- the result ----------------------------------------------------------------------

    def _metrics(self) -> RunMetrics:
        end_s = self.duration_s
        batches = [
            b.completed_s - b.started_s
            for b in self.rollout.batches.values()
            if b.completed_s is not None and b.started_s is not None
        ]
        return RunMetrics(
            policy=self.policy.name,
            seed=self.inputs.seed,
            duration_s=end_s,
            trajectories=self.rollout.ledger.num_accepted,
            unfinished=len(self.rollout.in_flight),
            output_tokens=self.rollout.output_tokens,
            train_steps=self.train_steps,
            gpu_hours_base=self.inputs.scenario.base_gpus * end_s / 3600,
            gpu_hours_borrowed=self.lent_clock.total_s(end_s) / 3600,
            gpu_hours_elastic=self.elastic.clock.total_s(end_s) / 3600,
            batch_times_s=tuple(batches),
            transitions=self.transitions,
            max_trainer_wait_s=self.max_wait_s,
            decisions=self.decisions,
            num_events=self.loop.num_processed,
            predictions=tuple(self.ledger.pairs),
            rollout=rollout_figures(self.rollout.ledger.totals, self.staleness),
        )


def simulate(
    inputs: RunInputs,
    policy: SimPolicy,
    sink: Sink | None = None,
    progress: Callable[[float], None] | None = None,
) -> RunMetrics:
    return Simulation(inputs, policy, sink).run(progress)
