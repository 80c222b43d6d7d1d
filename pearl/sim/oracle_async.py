"""The first-completed oracle: earliest update times, then the best count over ``u``.

The argument is in ``pearl.sim.oracle``'s docstring (steps F1-F8); this module computes
it. Slots are the stream's trajectories in order, slot ``j`` of group ``j // g``; a
finite stream is a run with no further trajectories. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np
from numpy.typing import NDArray

from pearl.core.profile import EngineProfile
from pearl.rollout.rules import PastBound, RolloutRules
from pearl.sim.availability import Window
from pearl.sim.oracle_costs import SMALLEST_TRAJECTORY, CostModel
from pearl.sim.trajectories import TrajectorySpec

F64 = NDArray[np.float64]
_CHUNK = 4096  # trajectories costed at a time


@dataclass(frozen=True)
class GpuSupply:
    """GPU-seconds any run has over ``[0, t]``: every base GPU from ``first_engine_s`` on
    and every window's GPUs from ``first_engine_s`` after its start to its end (no GPU
    serves before an engine is up on it, and none is up sooner)."""

    base_gpus: int
    windows: tuple[Window, ...]
    first_engine_s: float

    def _spans(self) -> list[tuple[float, float, int]]:
        f = self.first_engine_s
        spans = [(f, math.inf, self.base_gpus)]
        for w in self.windows:
            start_s = max(w.start_s, 0.0) + f
            if start_s < w.end_s:
                spans.append((start_s, w.end_s, w.num_gpus))
        return spans

    def gpu_s_by(self, t_s: float) -> float:
        return sum(n * max(0.0, min(t_s, end) - start) for start, end, n in self._spans())

    def time_for(self, gpu_s: float, extra_gpus: float = 0.0) -> float:
        """The earliest ``t`` with ``gpu_s_by(t) + extra_gpus t >= gpu_s`` (inf if never)."""
        if gpu_s <= 0.0:
            return 0.0

        def have(t_s: float) -> float:
            return self.gpu_s_by(t_s) + extra_gpus * t_s

        points = sorted({p for s, e, _ in self._spans() for p in (s, e) if p < math.inf})
        prev_t, prev_g = 0.0, 0.0
        for t in points:
            g = have(t)
            if g >= gpu_s:
                return prev_t + (gpu_s - prev_g) * (t - prev_t) / (g - prev_g)
            prev_t, prev_g = t, g
        slope = self.base_gpus + extra_gpus  # past the last point: base GPUs (and extra)
        return prev_t + (gpu_s - prev_g) / slope if slope > 0.0 else math.inf


@dataclass(frozen=True)
class AsyncBound:
    trajectories: int  # the largest over u of the smallest of the by_ counts (F7)
    updates: int  # the u it is reached at
    max_updates: int  # the most updates any run ends by T (F4)
    by_admission: int
    by_critical_path: int
    by_capacity: int
    by_in_flight: int
    by_blend: int  # capacity and in flight together (F8), the least over the prices
    capacity_gpu_s: float  # the rollout GPU-seconds at u: supply less training


class _Slots:
    """The stream's trajectories costed as far as read (whole groups only); arrays grow
    by doubling, ``own_s[:len(self)]`` etc. are the costed ones."""

    def __init__(self, stream: Iterable[TrajectorySpec], model: CostModel, g: int) -> None:
        self._it: Iterator[TrajectorySpec] = iter(stream)
        self._model, self._g = model, g
        self._n = 0
        self.own_s = np.zeros(0)
        self.work_gpu_s = np.zeros(0)
        self.blended_gpu_s = np.zeros((0, len(model.mus)))
        self.ended = False

    def __len__(self) -> int:
        return self._n

    def ensure(self, n: int) -> int:
        """Read until ``n`` slots are costed or the stream ends; the slots there are."""
        while self._n < n and not self.ended:
            want = max(n - self._n, _CHUNK)
            want += -want % self._g
            specs = list(islice(self._it, want))
            if len(specs) < want:
                self.ended = True
                specs = specs[: len(specs) - len(specs) % self._g]
            c = self._model.costs(specs)
            end = self._n + len(specs)
            if end > len(self.own_s):
                size = max(end, 2 * len(self.own_s))
                self.own_s = np.resize(self.own_s, size)
                self.work_gpu_s = np.resize(self.work_gpu_s, size)
                self.blended_gpu_s = np.resize(self.blended_gpu_s, (size, len(self._model.mus)))
            self.own_s[self._n : end] = c.own_s
            self.work_gpu_s[self._n : end] = c.work_gpu_s
            self.blended_gpu_s[self._n : end] = c.blended_gpu_s
            self._n = end
        return min(n, self._n)


def _cheapest_count(values: F64, budget: float) -> int:
    """How many of the smallest ``values`` fit in ``budget`` together."""
    return int(np.searchsorted(np.cumsum(np.sort(values)), budget, side="right"))


def _smallest_group_sum(values: F64, g: int, k: int) -> float:
    """The least total of ``k`` groups (of ``g`` consecutive values each)."""
    groups = values.reshape(-1, g).sum(axis=1)
    return float(np.sum(np.partition(groups, k - 1)[:k]))


def blend_prices(gpus: int, in_flight: float) -> tuple[float, ...]:
    """The prices of a second in flight (in GPUs) F8 tries: around GPUs per trajectory in
    flight, a factor 2 apart. Any positive price gives a valid bound; these find a tight one."""
    mid = gpus / in_flight
    return tuple(mid * 2.0**k for k in range(-6, 7))


def max_admitted(rules: RolloutRules, updates: int) -> int:
    """F2: the most stream slots admitted while ``updates`` updates are done. Admission
    keeps running + accepted within ``(η + updates + 1) B``, and only ``drop`` takes a
    trajectory out of that sum (``interrupt`` and ``restart`` start one past the bound
    again); a drop frees at most ``η B`` every ``η + 1`` updates."""
    B, eta = rules.batch_trajectories, rules.max_staleness_versions
    dropped = eta * B * (updates // (eta + 1)) if rules.past_bound is PastBound.DROP else 0
    return (eta + updates + 1) * B + dropped


def first_completed_bound(
    rules: RolloutRules,
    *,
    duration_s: float,
    train_s: float,
    first_engine_s: float,
    trainer_gpus: int,
    supply: GpuSupply,
    engines: Sequence[EngineProfile],
    stream: Iterable[TrajectorySpec],
) -> AsyncBound:
    """Steps F1-F8 of ``pearl.sim.oracle``; ``train_s`` must be positive."""
    if train_s <= 0.0:
        raise ValueError("the first-completed oracle needs a training step of > 0 s")
    T, B, g = duration_s, rules.batch_trajectories, rules.group_size
    eta, G = rules.max_staleness_versions, rules.groups_per_batch
    restart = rules.past_bound is PastBound.RESTART
    in_flight = float((eta + 1) * B)  # F6: running <= (η + 1) B, and <= max_in_flight
    capped = rules.max_in_flight is not None and rules.max_in_flight < in_flight
    if rules.max_in_flight is not None:
        in_flight = min(in_flight, float(rules.max_in_flight))
    mus = blend_prices(supply.base_gpus, in_flight)
    model = CostModel(engines, mus)
    smallest = model.costs([SMALLEST_TRAJECTORY])  # a restart's fresh sample, at least
    finish_min_s, work_min_gpu_s = float(smallest.own_s[0]), float(smallest.work_gpu_s[0])
    # in flight (F6, F8): a restart's last run is admitted by no one, so max_in_flight does
    # not cap it: there it counts nothing
    own_min_s = 0.0 if capped else finish_min_s
    blended_min_gpu_s = np.full(len(mus), work_min_gpu_s) if capped else smallest.blended_gpu_s[0]

    slots = _Slots(stream, model, g)
    ends_s = [0.0]  # ends_s[u]: the earliest end of update u (phase 0 opens at 0)
    phase = np.zeros(0, dtype=np.int64)  # p(j) of each eligible slot
    start_s = np.zeros(0)  # max(F, E_p(j)) (F3)

    def grow(u: int) -> int:
        """Make the slots of phases <= u eligible (``ends_s[u]`` known); their count."""
        nonlocal phase, start_s
        n = slots.ensure(max_admitted(rules, u))
        old = len(phase)
        if n > old:
            phase = np.concatenate((phase, np.full(n - old, u, dtype=np.int64)))
            start_s = np.concatenate((start_s, np.full(n - old, max(first_engine_s, ends_s[u]))))
        return n

    def costs_at(u: int, n: int) -> tuple[F64, F64, F64, F64]:
        """(finish, work, own time, blended) lower bounds of slots ``[0, n)`` once ``u``
        updates are done: a restart at update ``p + η + 1 <= u`` may have drawn a fresh
        sample (F3)."""
        finish = start_s[:n] + slots.own_s[:n]
        work, own = slots.work_gpu_s[:n], slots.own_s[:n]
        blended = slots.blended_gpu_s[:n]
        if restart:
            r = phase[:n] + eta + 1
            can = r <= u
            if can.any():
                alt = np.full(n, math.inf)
                alt[can] = np.asarray(ends_s)[r[can]] + finish_min_s
                finish = np.minimum(finish, alt)
                work = np.where(can, np.minimum(work, work_min_gpu_s), work)
                own = np.where(can, np.minimum(own, own_min_s), own)
                blended = np.where(can[:, None], np.minimum(blended, blended_min_gpu_s), blended)
        return finish, work, own, blended

    i = 1
    prices = list(range(len(mus)))  # all at first, then the tightest one's neighbours
    while True:  # F4: update i's earliest end
        n = grow(i - 1)
        k = i * G
        if n // g < k:
            break  # too few trajectories for i batches, ever
        finish, work, own, blended = costs_at(i - 1, n)
        trained_gpu_s = trainer_gpus * (i - 1) * train_s
        t_path = float(np.partition(finish.reshape(-1, g).max(axis=1), k - 1)[k - 1])
        t_capacity = supply.time_for(_smallest_group_sum(work, g, k) + trained_gpu_s)
        t_in_flight = _smallest_group_sum(own, g, k) / in_flight
        t_blend, tight = 0.0, prices[0]
        for c in prices:
            t = supply.time_for(
                _smallest_group_sum(blended[:, c], g, k) + trained_gpu_s, mus[c] * in_flight
            )
            if t > t_blend:
                t_blend, tight = t, c
        prices = [c for c in (tight - 1, tight, tight + 1) if 0 <= c < len(mus)]
        end_s = max(ends_s[i - 1], t_path, t_capacity, t_in_flight, t_blend) + train_s
        if end_s > T:
            break
        ends_s.append(end_s)
        i += 1
    max_updates = len(ends_s) - 1

    best: AsyncBound | None = None
    for u in range(max_updates, -1, -1):  # F7
        by_admission = (eta + u + 1) * B
        if best is not None and by_admission <= best.trajectories:
            break
        n = min(max_admitted(rules, u), len(phase))  # the loop made them eligible
        finish, work, own, blended = costs_at(u, n)
        done = finish <= T
        gpu_s = supply.gpu_s_by(T) - trainer_gpus * u * train_s
        by_path = int(np.count_nonzero(done))
        by_capacity = _cheapest_count(work[done], gpu_s)
        by_in_flight = _cheapest_count(own[done], in_flight * T)
        by_blend = min(
            _cheapest_count(blended[done, c], gpu_s + mu * in_flight * T)
            for c, mu in enumerate(mus)
        )
        count = min(by_admission, by_path, by_capacity, by_in_flight, by_blend)
        if best is None or count > best.trajectories:
            best = AsyncBound(
                count,
                u,
                max_updates,
                by_admission,
                by_path,
                by_capacity,
                by_in_flight,
                by_blend,
                gpu_s,
            )
    assert best is not None
    return best
