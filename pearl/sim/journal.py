"""Records of decisions, and the predictor's accuracy, as a simulated run sees them.

``decision_record`` and ``BorrowJournal`` turn a ``Decision`` into run-log records (a
return is logged once, when decided, not at every decision while it is under way).
``PredictionLedger`` pairs each decision's predicted completion time with the time the
run actually took to finish the same trajectories: those unfinished at the decision and
those then allowed to start (trajectories start in order, so "all of them finished" is
"every trajectory below an index finished").
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from pearl.core.decision import BorrowKind, Decision
from pearl.logschema import BorrowChanged, DecisionMade

_LOGGED_BORROWS: dict[BorrowKind, Literal["lend", "return", "force_return"]] = {
    BorrowKind.LEND: "lend",
    BorrowKind.RETURN: "return",
    BorrowKind.FORCE_RETURN: "force_return",
}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def decision_record(now_s: float, policy: str, d: Decision) -> DecisionMade:
    return DecisionMade.model_construct(
        t=now_s,
        policy=policy,
        pd_mode=d.plan.target.config.mode.value,
        target=d.plan.target.config.label(),
        switch=d.switch.switch,
        mandatory=d.switch.mandatory,
        predicted_current_s=_finite(d.current.completion_s),
        predicted_target_s=_finite(d.selection.best.completion_s),
        transition_s=d.plan.makespan_s,
        num_steps=len(d.plan.steps),
        borrow=d.borrow.kind.value,
        num_elastic_requests=len(d.elastic.requests),
        reasons=d.reasons,
    )


class BorrowJournal:
    def __init__(self) -> None:
        self._return_logged_for: float | None = None  # lent_at_s of the window

    def record(self, now_s: float, d: Decision) -> BorrowChanged | None:
        kind = _LOGGED_BORROWS.get(d.borrow.kind)
        if kind is None:
            return None
        window = d.state.borrow
        if kind != "lend":
            if window is None or self._return_logged_for == window.lent_at_s:
                return None  # a return already logged, repeated while under way
            self._return_logged_for = window.lent_at_s
        by_s = d.borrow.return_by_s
        return BorrowChanged.model_construct(
            t=now_s,
            kind=kind,
            gpu_ids=d.borrow.gpu_ids,
            return_by_t=_finite(by_s) if by_s is not None else None,
        )


class PredictionLedger:
    def __init__(self) -> None:
        self._open: deque[tuple[float, int, float]] = deque()  # (t, last index, predicted)
        self.pairs: list[tuple[float, float]] = []  # (predicted s, actual s)

    def note(self, now_s: float, last_index: int, predicted_s: float) -> None:
        """A decision at ``now_s`` predicted ``predicted_s`` for trajectories 0..last."""
        if last_index >= 0 and math.isfinite(predicted_s):
            self._open.append((now_s, last_index, predicted_s))

    def finished_below(self, now_s: float, index: int) -> None:
        """Every trajectory below ``index`` has finished by ``now_s``."""
        while self._open and self._open[0][1] < index:
            t, _, predicted_s = self._open.popleft()
            self.pairs.append((predicted_s, now_s - t))
