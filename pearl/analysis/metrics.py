"""Rollout and training figures of one run, accumulated record by record.

Each accumulator takes the records it needs (``handlers``: record type to method) and
keeps only per-bin counts or one small tuple per batch or training step, so a run log is
analysed in one streaming pass. ``summary`` turns what was seen into plain numbers for
``summary.json``; the series stay on the object for the plots.

- ``RunInfo``: ``run_started`` (the first; a later one is a restart of the writer),
  ``run_ended``, and the run's end: ``run_ended.t``, else the largest ``t`` seen.
- ``Throughput``: ``trajectory_finished``: count, output tokens, per ``BIN_S`` bin.
- ``Training``: ``train_step``: count, step time ``t - started_t``, ``waited_for_gpus_s``.
- ``Batches``: ``batch_completed``: actual time ``t - started_t`` against ``predicted_s``.
- ``Consumption``: ``batch_consumed`` and ``past_bound``: what the trainer took (off-policy
  share, staleness per batch) and what the staleness bound cost (restarts, drops, tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pearl.runlog.schema import (
    BatchCompleted,
    BatchConsumed,
    PastBoundApplied,
    RunEnded,
    RunStarted,
    TrainStep,
    TrajectoryFinished,
)

BIN_S = 10.0  # width of the throughput bins (s); the plots merge them
Handlers = dict[str, Callable[[Any], None]]


def rounded(x: float | None, digits: int = 6) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), digits)


def describe(values: list[float]) -> dict[str, float | None]:
    """mean, median, p99 (numpy's linear percentile, as ``pearl simulate``) and max."""
    if not values:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    a = np.asarray(values)
    return {
        "mean": rounded(float(np.mean(a))),
        "p50": rounded(float(np.percentile(a, 50))),
        "p99": rounded(float(np.percentile(a, 99))),
        "max": rounded(float(np.max(a))),
    }


@dataclass
class RunInfo:
    started: RunStarted | None = None
    restarts: int = 0
    ended_t: float | None = None
    ended_reason: str | None = None
    max_t: float = 0.0

    def handlers(self) -> Handlers:
        return {"run_started": self._on_started, "run_ended": self._on_ended}

    def see(self, t: float) -> None:
        if t > self.max_t:
            self.max_t = t

    def _on_started(self, r: RunStarted) -> None:
        if self.started is None:
            self.started = r
        else:
            self.restarts += 1

    def _on_ended(self, r: RunEnded) -> None:
        self.ended_t, self.ended_reason = r.t, r.reason

    @property
    def end_t(self) -> float:
        # records after a run_ended: a writer that went on (a requeued coordinator)
        return self.max_t if self.ended_t is None else max(self.ended_t, self.max_t)

    @property
    def duration_s(self) -> float:
        return self.end_t

    def summary(self) -> dict[str, Any]:
        s = self.started
        return {
            "run_id": s.run_id if s else None,
            "source": s.source if s else None,
            "policy": s.policy if s else None,
            "scenario": s.scenario if s else None,
            "seed": s.seed if s else None,
            "profile": s.profile if s else None,
            "duration_s": rounded(self.duration_s),
            "ended": self.ended_t is not None,
            "ended_reason": self.ended_reason,
            "restarts": self.restarts,
        }

    def notes(self) -> list[str]:
        out = []
        if self.started is None:
            out.append("no run_started record: run identity unknown")
        if self.ended_t is None:
            out.append("no run_ended record: the run's end is its last record's t")
        if self.restarts:
            out.append(f"{self.restarts} later run_started record(s): the writer restarted")
        return out


@dataclass
class Throughput:
    trajectories: int = 0
    output_tokens: int = 0
    turns: int = 0
    bins: dict[int, list[int]] = field(default_factory=dict)  # bin -> [trajectories, tokens]
    bin_s: float = BIN_S

    def handlers(self) -> Handlers:
        return {"trajectory_finished": self._on_traj}

    def _on_traj(self, r: TrajectoryFinished) -> None:
        self.trajectories += 1
        self.output_tokens += r.output_tokens
        self.turns += r.num_turns
        k = int(r.t // self.bin_s)
        b = self.bins.get(k)
        if b is None:
            self.bins[k] = [1, r.output_tokens]
        else:
            b[0] += 1
            b[1] += r.output_tokens

    def series(self, end_t: float) -> tuple[list[float], list[int], list[int]]:
        """Bin starts (s), trajectories and tokens finished in each bin, empty bins included."""
        n = max(1, math.ceil(end_t / self.bin_s), max(self.bins, default=-1) + 1)
        starts = [i * self.bin_s for i in range(n)]
        traj = [self.bins.get(i, [0, 0])[0] for i in range(n)]
        tokens = [self.bins.get(i, [0, 0])[1] for i in range(n)]
        return starts, traj, tokens

    def summary(self, duration_s: float, taken_back: int = 0) -> dict[str, Any]:
        """``taken_back``: finished trajectories an update restarted or dropped later
        (``past_bound``): they do not count as finished."""
        hours = duration_s / 3600.0
        finished = self.trajectories - taken_back
        per_min: dict[int, int] = {}  # whole minutes of the run clock
        for k, (n, _) in self.bins.items():
            minute = int(k * self.bin_s // 60.0)
            per_min[minute] = per_min.get(minute, 0) + n
        return {
            "trajectories": finished,
            "output_tokens": self.output_tokens,
            "turns": self.turns,
            "throughput_traj_per_h": rounded(finished / hours) if hours else None,
            "tokens_per_s": rounded(self.output_tokens / duration_s) if duration_s else None,
            "peak_traj_per_min": max(per_min.values(), default=0),
        }


@dataclass
class Training:
    steps: list[tuple[float, int, float, float]] = field(default_factory=list)  # t, step, ...

    def handlers(self) -> Handlers:
        return {"train_step": self._on_step}

    def _on_step(self, r: TrainStep) -> None:
        self.steps.append((r.t, r.step, r.started_t, r.waited_for_gpus_s))

    @property
    def waits_s(self) -> list[float]:
        return [w for _, _, _, w in self.steps]

    def summary(self, duration_s: float) -> dict[str, Any]:
        hours = duration_s / 3600.0
        return {
            "train_steps": len(self.steps),
            "train_steps_per_h": rounded(len(self.steps) / hours) if hours else None,
            "step_s": describe([t - started for t, _, started, _ in self.steps]),
        }


@dataclass
class Batches:
    done: list[tuple[int, float, float, float | None]] = field(default_factory=list)
    # (batch_id, started_t, completed_t, predicted_s)

    def handlers(self) -> Handlers:
        return {"batch_completed": self._on_batch}

    def _on_batch(self, r: BatchCompleted) -> None:
        # A first-completed batch an update took a group back from completes again: its
        # last record counts (records come in time order).
        if self.done and self.done[-1][0] == r.batch_id:
            self.done.pop()
        self.done.append((r.batch_id, r.started_t, r.t, r.predicted_s))

    def pairs(self) -> list[tuple[float, float]]:
        """(predicted s, actual s) of every batch that had a prediction."""
        return [(p, t - s) for _, s, t, p in self.done if p is not None]

    def summary(self) -> dict[str, Any]:
        actual = [t - s for _, s, t, _ in self.done]
        pairs = [(p, a) for p, a in self.pairs() if a > 0]
        err = [p - a for p, a in pairs]
        ape = [abs(p - a) / a for p, a in pairs]
        return {
            "completed": len(self.done),
            "batch_time_s": describe(actual),
            "prediction": {
                "n": len(pairs),
                "unpredicted": sum(1 for *_, p in self.done if p is None),
                "mean_abs_error_s": rounded(float(np.mean(np.abs(err)))) if err else None,
                "mean_error_s": rounded(float(np.mean(err))) if err else None,
                "mape": rounded(float(np.mean(ape))) if ape else None,
                "median_ape": rounded(float(np.median(ape))) if ape else None,
                "p90_ape": rounded(float(np.percentile(ape, 90))) if ape else None,
                "max_ape": rounded(max(ape)) if ape else None,
            },
        }


@dataclass
class Consumption:
    batches: list[tuple[float, int, int, int, float]] = field(default_factory=list)
    # (t, trajectories, off-policy tokens, max staleness, mean staleness), per batch
    tokens: int = 0
    off_policy_tokens: int = 0
    interrupted: int = 0
    restarted: int = 0
    dropped: int = 0
    wasted_tokens: int = 0
    taken_back: int = 0

    def handlers(self) -> Handlers:
        return {"batch_consumed": self._on_batch, "past_bound": self._on_past_bound}

    def _on_batch(self, r: BatchConsumed) -> None:
        self.batches.append(
            (
                r.t,
                r.trajectories,
                r.off_policy_tokens,
                r.max_staleness_versions,
                r.mean_staleness_versions,
            )
        )
        self.tokens += r.output_tokens
        self.off_policy_tokens += r.off_policy_tokens

    def _on_past_bound(self, r: PastBoundApplied) -> None:
        self.interrupted += r.interrupted
        self.restarted += r.restarted
        self.dropped += r.dropped
        self.wasted_tokens += r.wasted_tokens
        self.taken_back += r.taken_back

    def summary(self) -> dict[str, Any]:
        return {
            "batches": len(self.batches),
            "consumed": sum(b[1] for b in self.batches),
            "taken_back": self.taken_back,
            "off_policy_share": rounded(self.off_policy_tokens / self.tokens)
            if self.tokens
            else None,
            "max_staleness_versions": describe([float(b[3]) for b in self.batches]),
            "mean_staleness_versions": describe([b[4] for b in self.batches]),
            "interrupted": self.interrupted,
            "restarted": self.restarted,
            "dropped": self.dropped,
            "wasted_tokens": self.wasted_tokens,
        }
