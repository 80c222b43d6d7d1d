"""The control side of one run: PD configurations and transitions, borrow windows and
elastic allocations, accumulated record by record (one streaming pass, like
``pearl.analysis.metrics``).

- ``PdTimeline``: ``decision`` and ``plan_step``. The configuration in force is the
  target label of the last decision, from the moment its plan ended; a decision with
  plan steps (``num_steps > 0``) is a transition, and the ``plan_step`` records that
  follow it, until the next decision, are its steps (one plan runs at a time), so its
  measured cost is the last step's ``t`` minus the decision's ``t``.
- ``BorrowWindows``: ``borrow`` records: ``lend`` opens a window, ``return`` or
  ``force_return`` decides its end, ``returned`` closes it. Lent GPU-hours count every
  lent GPU from the lend decision to ``returned`` (or the run's end): an upper bound of
  the time the GPUs were away (they leave and come back during plan steps).
- ``ElasticUse``: ``allocation`` records per ``allocation_id``: GPUs held from
  ``granted`` to ``ended`` (preempted), ``released`` (by the policy) or the run's end.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pearl.analysis.metrics import describe, rounded
from pearl.core.state import EndReason
from pearl.runlog.schema import AllocationChanged, BorrowChanged, DecisionMade, PlanStepDone

Handlers = dict[str, Callable[[Any], None]]
_HEAD = re.compile(r"^(?:disaggregated (?P<p>\d+)P:(?P<d>\d+)D|(?P<mode>\w+) (?P<c>\d+)C)")
_INSTANCE = re.compile(r"(\w+):([\w.-]+)x(\d+) x(\d+)")
MAX_LISTED = 200  # transitions, windows and allocations listed in summary.json per run


@dataclass(frozen=True)
class PdPoint:
    t: float
    mode: str
    prefill: int
    decode: int
    colocated: int
    gpus: int  # GPUs the configuration's instances use
    label: str


def parse_label(t: float, mode: str, label: str) -> PdPoint:
    """A configuration label (``pearl.core.pd.PDConfig.label``) as numbers."""
    m = _HEAD.match(label)
    p = int(m["p"]) if m and m["p"] else 0
    d = int(m["d"]) if m and m["d"] else 0
    c = int(m["c"]) if m and m["c"] else 0
    gpus = sum(int(tp) * int(n) for _, _, tp, n in _INSTANCE.findall(label))
    return PdPoint(t, mode, p, d, c, gpus, label)


@dataclass
class Transition:
    t: float
    from_label: str
    to_label: str
    mandatory: bool
    reason: str
    predicted_s: float
    num_steps: int
    steps_done: int = 0
    steps_failed: int = 0
    end_t: float | None = None

    @property
    def measured_s(self) -> float | None:
        return None if self.end_t is None else self.end_t - self.t

    def as_dict(self) -> dict[str, Any]:
        return {
            "t": rounded(self.t),
            "from": self.from_label,
            "to": self.to_label,
            "mandatory": self.mandatory,
            "reason": self.reason,
            "predicted_s": rounded(self.predicted_s),
            "measured_s": rounded(self.measured_s),
            "num_steps": self.num_steps,
            "steps_done": self.steps_done,
            "steps_failed": self.steps_failed,
        }


def _main_reason(reasons: tuple[str, ...]) -> str:
    for prefix in ("switch:", "select:"):
        for r in reasons:
            if r.startswith(prefix):
                return r
    return reasons[0] if reasons else ""


@dataclass
class PdTimeline:
    decisions: int = 0
    switches: int = 0
    points: list[PdPoint] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    plan_steps: int = 0
    plan_steps_failed: int = 0
    plan_steps_s: float = 0.0  # summed over steps (steps of one plan overlap)
    decide_calls: int = 0  # measured ones (decision records with decide_s)
    decide_s: float = 0.0
    _open: Transition | None = None
    _pending: DecisionMade | None = None  # the decision whose configuration comes next

    def handlers(self) -> Handlers:
        return {"decision": self._on_decision, "plan_step": self._on_step}

    def _close(self) -> None:
        d, tr = self._pending, self._open
        if d is not None:
            at_t = tr.end_t if tr is not None and tr.end_t is not None else d.t
            if not self.points or self.points[-1].label != d.target:
                self.points.append(parse_label(at_t, d.pd_mode, d.target))
        self._open = self._pending = None

    def _on_decision(self, r: DecisionMade) -> None:
        self._close()
        self.decisions += 1
        self.switches += r.switch
        if r.decide_s is not None:
            self.decide_calls += r.decide_calls
            self.decide_s += r.decide_s
        self._pending = r
        if r.num_steps > 0:
            current = self.points[-1].label if self.points else ""
            tr = Transition(
                r.t,
                current,
                r.target,
                r.mandatory,
                _main_reason(r.reasons),
                r.transition_s,
                r.num_steps,
            )
            self.transitions.append(tr)
            self._open = tr

    def _on_step(self, r: PlanStepDone) -> None:
        self.plan_steps += 1
        self.plan_steps_failed += not r.ok
        self.plan_steps_s += max(0.0, r.t - r.started_t)
        tr = self._open
        if tr is not None:
            tr.steps_done += 1
            tr.steps_failed += not r.ok
            tr.end_t = r.t if tr.end_t is None else max(tr.end_t, r.t)

    def finish(self) -> None:
        self._close()

    def summary(self, duration_s: float | None = None) -> dict[str, Any]:
        """``duration_s``: the run's, for the coordinator's overhead as a share of it."""
        self.finish()
        measured = [m for tr in self.transitions if (m := tr.measured_s) is not None]

        def share(x: float) -> float | None:
            return rounded(x / duration_s, 4) if duration_s else None

        return {
            "decisions": self.decisions,
            "switches": self.switches,
            "transitions": len(self.transitions),
            "plan_steps": self.plan_steps,
            "plan_steps_failed": self.plan_steps_failed,
            "plan_steps_s": rounded(self.plan_steps_s),
            "decide_calls": self.decide_calls,
            "decide_s": rounded(self.decide_s),
            "decide_ms_mean": rounded(1000 * self.decide_s / self.decide_calls)
            if self.decide_calls
            else None,
            "decide_share": share(self.decide_s) if self.decide_calls else None,
            "plan_steps_share": share(self.plan_steps_s),
            "transition_measured_s": describe(measured),
            "transition_predicted_s": describe([tr.predicted_s for tr in self.transitions]),
            "configurations": [
                {
                    "t": rounded(p.t),
                    "mode": p.mode,
                    "P": p.prefill,
                    "D": p.decode,
                    "C": p.colocated,
                    "gpus": p.gpus,
                }
                for p in self.points[:MAX_LISTED]
            ],
            "transition_list": [tr.as_dict() for tr in self.transitions[:MAX_LISTED]],
        }


@dataclass
class BorrowWindow:
    lent_t: float
    gpus: int
    return_by_t: float | None
    return_t: float | None = None
    return_kind: str | None = None
    returned_t: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "lent_t": rounded(self.lent_t),
            "gpus": self.gpus,
            "return_by_t": rounded(self.return_by_t),
            "return_t": rounded(self.return_t),
            "return_kind": self.return_kind,
            "returned_t": rounded(self.returned_t),
        }


@dataclass
class BorrowWindows:
    windows: list[BorrowWindow] = field(default_factory=list)
    unmatched_returns: int = 0
    unclosed_windows: int = 0  # closed by the next lend (a log without "returned")

    def handlers(self) -> Handlers:
        return {"borrow": self._on_borrow}

    def _on_borrow(self, r: BorrowChanged) -> None:
        w = self.windows[-1] if self.windows and self.windows[-1].returned_t is None else None
        if r.kind == "lend":
            if w is not None:  # no "returned" before the next lend: the window ended here
                w.returned_t = r.t
                self.unclosed_windows += 1
            self.windows.append(BorrowWindow(r.t, len(r.gpu_ids), r.return_by_t))
        elif w is None:
            self.unmatched_returns += 1
        elif r.kind == "returned":
            w.returned_t = r.t
        else:
            w.return_t, w.return_kind = r.t, r.kind
            if r.return_by_t is not None:
                w.return_by_t = r.return_by_t

    def lent_gpu_hours(self, end_t: float) -> float:
        return (
            sum(
                w.gpus * ((w.returned_t if w.returned_t is not None else end_t) - w.lent_t)
                for w in self.windows
            )
            / 3600.0
        )

    def summary(
        self, end_t: float, waits_s: list[float], max_return_delay_s: float | None
    ) -> dict[str, Any]:
        delays = [
            w.returned_t - w.return_t
            for w in self.windows
            if w.returned_t is not None and w.return_t is not None
        ]
        late = [
            w.returned_t - w.return_by_t
            for w in self.windows
            if w.returned_t is not None
            and w.return_by_t is not None
            and w.returned_t > w.return_by_t
        ]
        waited = [w for w in waits_s if w > 0]
        return {
            "windows": len(self.windows),
            "force_returns": sum(1 for w in self.windows if w.return_kind == "force_return"),
            "unmatched_returns": self.unmatched_returns,
            "unclosed_windows": self.unclosed_windows,
            "lent_gpu_hours": rounded(self.lent_gpu_hours(end_t)),
            "return_delay_s": describe(delays),
            "late_returns": len(late),
            "max_late_s": rounded(max(late, default=0.0)),
            "trainer_wait": {
                "steps_waited": len(waited),
                "max_s": rounded(max(waits_s, default=0.0)),
                "mean_s": rounded(sum(waited) / len(waited)) if waited else 0.0,
                "total_s": rounded(sum(waited)),
                "max_return_delay_s": max_return_delay_s,
                "over_limit": (
                    None
                    if max_return_delay_s is None
                    else sum(1 for w in waits_s if w > max_return_delay_s)
                ),
            },
            "window_list": [w.as_dict() for w in self.windows[:MAX_LISTED]],
        }


@dataclass
class Allocation:
    allocation_id: str
    gpu_type: str
    num_gpus: int
    requested_t: float | None = None
    granted_t: float | None = None
    preempting_t: float | None = None
    end_t: float | None = None
    end_status: str | None = None  # "ended" or "released" (the simulator's, by the policy)
    end_reason: str = ""  # the coordinator's: preempted, released, completed, lost, ...

    @property
    def released(self) -> bool:
        return self.end_status == "released" or self.end_reason == "released"

    @property
    def preempted(self) -> bool:
        """A preemption notice, or an end the owner caused (``preempted``)."""
        if self.preempting_t is not None:
            return True
        return self.end_status == "ended" and self.end_reason in PREEMPTION_REASONS

    def held_until(self, run_end_t: float) -> float:
        return self.end_t if self.end_t is not None else run_end_t

    def granted_gpu_hours(self, run_end_t: float) -> float:
        if self.granted_t is None:
            return 0.0
        return self.num_gpus * max(0.0, self.held_until(run_end_t) - self.granted_t) / 3600.0


# An ``ended`` record without a reason is a simulator log's (the owner's end of a window),
# and simulator logs said "reclaimed" before the one vocabulary of pearl.core.state.EndReason.
PREEMPTION_REASONS = frozenset({"", EndReason.PREEMPTED.value, "reclaimed"})


def is_preemption(reason: str) -> bool:
    """Whether a removal's or an end's reason is the owner taking the GPUs back."""
    return reason in PREEMPTION_REASONS and reason != ""


@dataclass
class ElasticUse:
    allocations: dict[str, Allocation] = field(default_factory=dict)

    def handlers(self) -> Handlers:
        return {"allocation": self._on_allocation}

    def _on_allocation(self, r: AllocationChanged) -> None:
        a = self.allocations.get(r.allocation_id)
        if a is None:
            a = Allocation(r.allocation_id, r.gpu_type, r.num_gpus)
            self.allocations[r.allocation_id] = a
        if r.num_gpus:
            a.num_gpus = r.num_gpus
        if r.status in ("requested", "pending"):
            a.requested_t = r.t if a.requested_t is None else a.requested_t
        elif r.status == "granted":
            a.granted_t = r.t if a.granted_t is None else a.granted_t  # a repeat: no-op
        elif r.status == "preempting":
            a.preempting_t = r.t
        elif a.end_t is None:  # ended or released
            a.end_t, a.end_status, a.end_reason = r.t, r.status, r.reason

    def summary(self, end_t: float, used_gpu_hours: float | None) -> dict[str, Any]:
        allocs = list(self.allocations.values())
        granted = [a for a in allocs if a.granted_t is not None]
        preempted = [a for a in granted if a.preempted]
        waiting_h = (
            sum(
                a.num_gpus
                * (
                    (a.granted_t if a.granted_t is not None else a.held_until(end_t))
                    - a.requested_t
                )
                for a in allocs
                if a.requested_t is not None
            )
            / 3600.0
        )
        lost_h = (
            sum(
                a.num_gpus * (a.held_until(end_t) - a.preempting_t)
                for a in preempted
                if a.preempting_t is not None
            )
            / 3600.0
        )
        waits = [
            a.granted_t - a.requested_t
            for a in granted
            if a.granted_t is not None and a.requested_t is not None
        ]
        return {
            "requests": sum(1 for a in allocs if a.requested_t is not None),
            "requested_gpus": sum(a.num_gpus for a in allocs if a.requested_t is not None),
            "granted": len(granted),
            "granted_gpus": sum(a.num_gpus for a in granted),
            "never_granted": len(allocs) - len(granted),
            "grant_wait_s": describe(waits),
            "requested_waiting_gpu_hours": rounded(waiting_h),
            "granted_gpu_hours": rounded(sum(a.granted_gpu_hours(end_t) for a in allocs)),
            "used_gpu_hours": rounded(used_gpu_hours),
            "preempted": len(preempted),
            "released": sum(1 for a in allocs if a.released),
            "lost_to_preemption_gpu_hours": rounded(lost_h),
            "allocation_list": [
                {
                    "id": a.allocation_id,
                    "gpus": a.num_gpus,
                    "requested_t": rounded(a.requested_t),
                    "granted_t": rounded(a.granted_t),
                    "preempting_t": rounded(a.preempting_t),
                    "end_t": rounded(a.end_t),
                    "end": a.end_status,
                    "end_reason": a.end_reason,
                }
                for a in allocs[:MAX_LISTED]
            ],
        }
