"""The predictor's accuracy, as a simulated run sees it.

``PredictionLedger`` pairs each decision's predicted time with the time the run actually
took to reach what was predicted. In-order batches: to finish the same trajectories,
those unfinished at the decision and those then allowed to start (trajectories start in
order, so "all of them finished" is "every trajectory below an index finished").
First-completed batches: until the trainer's next batch is complete (``batch_ready``).

``prediction_errors`` sums up the pairs of one or more runs (``pearl bench predictor``,
``pearl simulate``'s ``predictor`` entry): ``mape`` is the mean of ``|predicted - actual| /
actual``, ``largest`` the decisions of the largest such errors, each with its seed and time
(the decision record's in the run log): a decision a moment before its batch completes can
carry a mean of relative errors alone.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple

import numpy as np


class Prediction(NamedTuple):
    """One decision's predicted time, the time the run took, and when it was decided (the
    time of its record in the run log)."""

    predicted_s: float
    actual_s: float
    decided_s: float


class PredictionLedger:
    def __init__(self) -> None:
        self._open: deque[tuple[float, int, float]] = deque()  # (t, last index, predicted)
        self._batch: list[tuple[float, float]] = []  # (t, predicted)
        self.pairs: list[Prediction] = []

    def note(self, now_s: float, last_index: int, predicted_s: float) -> None:
        """A decision at ``now_s`` predicted ``predicted_s`` for trajectories 0..last."""
        if last_index >= 0 and math.isfinite(predicted_s):
            self._open.append((now_s, last_index, predicted_s))

    def note_batch(self, now_s: float, predicted_s: float) -> None:
        """A decision at ``now_s`` predicted the next batch complete ``predicted_s`` later."""
        if math.isfinite(predicted_s):
            self._batch.append((now_s, predicted_s))

    def batch_ready(self, now_s: float) -> None:
        """The next batch is complete at ``now_s``: every open batch prediction resolves."""
        for t, predicted_s in self._batch:
            self.pairs.append(Prediction(predicted_s, now_s - t, t))
        self._batch.clear()

    def finished_below(self, now_s: float, index: int) -> None:
        """Every trajectory below ``index`` has finished by ``now_s``."""
        while self._open and self._open[0][1] < index:
            t, _, predicted_s = self._open.popleft()
            self.pairs.append(Prediction(predicted_s, now_s - t, t))


_LARGEST = 3  # decisions of the largest errors reported


def prediction_errors(seeded: list[tuple[int, Prediction]]) -> dict[str, Any]:
    """MAPE, median and mean ratio of the predicted and actual batch times of (seed,
    prediction) pairs, and the decisions of the largest errors. A decision taken at the
    instant its batch completed (actual 0 s) has no relative error: it is counted in
    ``excluded``, not in the figures (one made the mean infinite on the 8B paper
    scenario)."""
    kept = [(seed, p) for seed, p in seeded if p.actual_s > 0]
    predicted = np.array([p.predicted_s for _, p in kept])
    actual = np.array([p.actual_s for _, p in kept])
    ape = np.abs(predicted - actual) / actual
    largest = [
        {"seed": kept[i][0], **kept[i][1]._asdict()}
        for i in np.argsort(-ape, kind="stable")[:_LARGEST]
    ]
    return {
        "mape": float(np.mean(ape)) if kept else None,
        "largest": largest,
        "n": len(kept),
        "excluded": len(seeded) - len(kept),
        "median_ape": float(np.median(ape)) if kept else None,
        "mean_ratio_predicted_to_actual": float(np.mean(predicted / actual)) if kept else None,
    }
