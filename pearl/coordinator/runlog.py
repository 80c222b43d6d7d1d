"""The coordinator's run log: ``RUN_DIR/events.jsonl``, the schema the simulator writes.

A requeued coordinator appends to the same file: ``run_started`` is written once, when the
file is new, and the timeline continues from the journalled state (the records of a
change are written before it is journalled, so a crash between the two repeats the
records of the last change, never loses them; readers take a repeated record as a
no-op). Times are the run clock.

What is logged: the GPU, worker and allocation changes of each new state
(``pearl.runlog.records.state_records``); an allocation ``granted`` when Slurm grants it
(its GPUs reach the state later, once its agents joined, and that ``granted`` repeats);
a ``decision`` record when a decision plans, asks for or releases allocations, or lends
or returns GPUs, and otherwise at most once every ``quiet_decision_interval_s`` (each
with the wall time decide() took, ``decide_s``, over the ``decide_calls`` it covers: the
quiet decisions not logged before it included, so that their sum is decide()'s time; the
last quiet one is logged at close, with those after the last record);
``borrow`` records (``lend``, ``return`` when decided, ``returned`` when the state no
longer has the window); a ``plan_step`` record per step executed; ``run_ended`` when the
run ends (not when a signal stops this incarnation: the next one continues).
"""

from __future__ import annotations

from pathlib import Path

from pearl.core.decision import BorrowKind, Decision
from pearl.core.execution import PlanOutcome
from pearl.core.observation import AllocationGranted
from pearl.core.plan import TransitionPlan
from pearl.core.state import AllocationStatus, ClusterState
from pearl.runlog.jsonl import RunLogWriter
from pearl.runlog.records import BorrowRecords, decision_record, state_records
from pearl.runlog.schema import AllocationChanged, BorrowChanged, PlanStepDone, RunEnded, RunStarted

POLICY = "pearl"


class CoordinatorLog:
    def __init__(
        self,
        path: Path,
        run_id: str,
        profile: str,
        logged: ClusterState | None,
        now_s: float,
        max_return_delay_s: float | None = None,
        quiet_decision_interval_s: float = 60.0,
    ) -> None:
        fresh = not path.exists() or path.stat().st_size == 0
        self._writer = RunLogWriter(path)
        self._logged = logged
        self._borrows = BorrowRecords()
        self._quiet_s = quiet_decision_interval_s
        self._last_decision_s: float | None = None
        self._unlogged_decide_s, self._unlogged_calls = 0.0, 0  # decisions not logged
        self._unlogged: tuple[Decision, float] | None = None  # the last one, and when
        if fresh:
            self._writer.write(
                RunStarted.model_construct(
                    t=now_s,
                    run_id=run_id,
                    source="coordinator",
                    policy=POLICY,
                    scenario="",
                    seed=None,
                    profile=profile,
                    max_return_delay_s=max_return_delay_s,
                )
            )

    def state(self, state: ClusterState, now_s: float) -> None:
        for record in state_records(self._logged, state, now_s):
            self._writer.write(record)
        window = None if self._logged is None else self._logged.borrow
        if window is not None and state.borrow is None:  # the trainer has its GPUs back
            self._writer.write(
                BorrowChanged.model_construct(t=now_s, kind="returned", gpu_ids=window.gpu_ids)
            )
        self._logged = state

    def granted(self, grant: AllocationGranted, now_s: float) -> None:
        """Slurm granted an allocation: its hours count from now, although its GPUs reach
        the state (and their ``granted`` record is repeated) once its agents joined."""
        if self._logged is not None:
            old = self._logged.allocation_by_id.get(grant.allocation_id)
            if old is not None and old.status is not AllocationStatus.PENDING:
                return  # granted before (a restarted coordinator sees the grant again)
        self._writer.write(
            AllocationChanged.model_construct(
                t=now_s,
                allocation_id=grant.allocation_id,
                status="granted",
                gpu_type=grant.nodes[0].gpu_type,
                num_gpus=sum(n.num_gpus for n in grant.nodes),
                reason="",
            )
        )

    def decision(self, d: Decision, now_s: float, decide_s: float | None = None) -> None:
        """A decision; ``decide_s``: the wall time decide() took (a quiet decision that is
        not logged adds its time to the next record)."""
        acted = (
            not d.plan.empty
            or d.elastic.requests
            or d.elastic.releases
            or d.borrow.kind not in (BorrowKind.NONE, BorrowKind.KEEP)
        )
        last = self._last_decision_s
        calls, spent_s = self._unlogged_calls + 1, self._unlogged_decide_s + (decide_s or 0.0)
        if acted or last is None or now_s - last >= self._quiet_s:
            measured = None if decide_s is None else spent_s
            self._writer.write(decision_record(now_s, POLICY, d, measured, calls))
            self._last_decision_s = now_s
            calls, spent_s = 0, 0.0
        self._unlogged_calls, self._unlogged_decide_s = calls, spent_s
        self._unlogged = (d, now_s) if calls else None
        borrow = self._borrows.record(now_s, d)
        if borrow is not None:
            self._writer.write(borrow)

    def plan(self, plan: TransitionPlan, outcome: PlanOutcome, now_s: float) -> None:
        steps = {s.step_id: s for s in plan.steps}
        for s in outcome.steps:
            step = steps[s.step_id]
            self._writer.write(
                PlanStepDone.model_construct(
                    t=now_s + s.ended_s,
                    action=step.action.value,
                    worker_id=step.worker_id,
                    started_t=now_s + s.started_s,
                    ok=s.ok,
                    error=s.error,
                )
            )

    def close(self, now_s: float, ended: str | None) -> None:
        """Flush and close; ``ended`` is the reason the run ended, None if it goes on. The
        quiet decisions since the last record are logged first, in the last one's record."""
        if self._unlogged is not None:
            d, t = self._unlogged
            spent_s = self._unlogged_decide_s
            self._writer.write(decision_record(t, POLICY, d, spent_s, self._unlogged_calls))
            self._unlogged, self._unlogged_calls, self._unlogged_decide_s = None, 0, 0.0
        if ended is not None:
            self._writer.write(RunEnded.model_construct(t=now_s, reason=ended))
        self._writer.close()
