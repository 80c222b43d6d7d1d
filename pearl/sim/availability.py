"""Elastic availability windows: from an idle-GPU series, or synthetic (pure).

A ``Window`` is a block of ``num_gpus`` external GPUs usable from ``start_s`` until
``end_s``, when the owner reclaims them.

Rule for a series (``windows_from_idle_series``; the Helios ``idle_gpu_num`` per minute):

1. Each sample holds until the next one; the last holds for the median sampling step.
2. Idle GPUs are counted in whole nodes: ``idle_nodes = idle_gpus // gpus_per_node``
   (pearl grants whole nodes; a partly idle node is not lendable).
3. The series is cut into stacked layers: node layer ``k`` (1-based) is available while
   ``idle_nodes >= k``. Each maximal run of layer ``k`` is a window of one node. So a
   window of ``g`` nodes opens when idle nodes rise by ``g`` and the most recently opened
   windows close first when they fall (the owner reclaims last-lent nodes first).
4. Runs shorter than ``min_duration_s`` are dropped (too short to start an engine).
5. Windows of adjacent layers with the same start and end are merged into one window.

Invariants (``tests/sim/test_availability.py``): at every instant the GPUs of the open
windows sum to at most ``gpus_per_node * (idle_gpus // gpus_per_node)``, hence never more
than the series' maximum; every window lasts at least ``min_duration_s``; ``num_gpus`` is a
positive multiple of ``gpus_per_node``; the output is sorted by (start, end, size).

Synthetic rule (``synthetic_windows``): windows arrive as a Poisson process of rate
``arrivals_per_h``; lifetimes are lognormal with mean ``mean_lifetime_s`` and log-space
standard deviation ``lifetime_sigma``; each window has ``num_nodes`` nodes; an arrival that
would push the open GPUs above ``max_gpus`` is dropped; windows end at ``horizon_s`` at
the latest. Both functions are deterministic (the synthetic one for a given ``rng`` state).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

GPUS_PER_NODE = 8


@dataclass(frozen=True, order=True)
class Window:
    start_s: float
    end_s: float
    num_gpus: int
    gpu_type: str

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[i, j)`` of True in a boolean array."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def windows_from_idle_series(
    time_s: ArrayLike,
    idle_gpus: ArrayLike,
    *,
    gpu_type: str,
    min_duration_s: float = 600.0,
    gpus_per_node: int = GPUS_PER_NODE,
) -> tuple[Window, ...]:
    """Availability windows of an idle-GPU series by the rule of the module docstring."""
    t = np.asarray(time_s, dtype=np.float64).ravel()
    idle = np.asarray(idle_gpus, dtype=np.int64).ravel()
    if t.size != idle.size or t.size < 2:
        raise ValueError("time_s and idle_gpus must have the same length, at least 2")
    if np.any(np.diff(t) <= 0):
        raise ValueError("time_s must be strictly increasing")
    if np.any(idle < 0) or gpus_per_node < 1:
        raise ValueError("idle_gpus must be >= 0 and gpus_per_node >= 1")
    ends = np.append(t[1:], t[-1] + float(np.median(np.diff(t))))
    nodes = idle // gpus_per_node
    per_layer: dict[tuple[float, float], int] = {}
    for layer in range(1, int(nodes.max(initial=0)) + 1):
        for a, b in _runs(nodes >= layer):
            start, end = float(t[a]), float(ends[b - 1])
            if end - start >= min_duration_s:
                per_layer[(start, end)] = per_layer.get((start, end), 0) + 1
    return tuple(
        sorted(Window(s, e, n * gpus_per_node, gpu_type) for (s, e), n in per_layer.items())
    )


def synthetic_windows(
    rng: np.random.Generator,
    *,
    horizon_s: float,
    arrivals_per_h: float,
    mean_lifetime_s: float,
    lifetime_sigma: float,
    gpu_type: str,
    num_nodes: int = 1,
    max_gpus: int | None = None,
    gpus_per_node: int = GPUS_PER_NODE,
) -> tuple[Window, ...]:
    """Poisson arrivals with lognormal lifetimes, capped at ``max_gpus`` open at once."""
    if horizon_s <= 0 or arrivals_per_h <= 0 or mean_lifetime_s <= 0 or lifetime_sigma < 0:
        raise ValueError("horizon, rate and mean lifetime must be > 0, sigma >= 0")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    size_gpus = num_nodes * gpus_per_node
    log_mu = math.log(mean_lifetime_s) - lifetime_sigma**2 / 2.0
    out: list[Window] = []
    open_ends_s: list[float] = []  # heap of the end times of the accepted open windows
    now_s = 0.0
    while True:
        now_s += float(rng.exponential(3600.0 / arrivals_per_h))
        if now_s >= horizon_s:
            break
        end_s = min(horizon_s, now_s + float(rng.lognormal(log_mu, lifetime_sigma)))
        while open_ends_s and open_ends_s[0] <= now_s:
            heapq.heappop(open_ends_s)
        if max_gpus is None or (len(open_ends_s) + 1) * size_gpus <= max_gpus:
            heapq.heappush(open_ends_s, end_s)
            out.append(Window(now_s, end_s, size_gpus, gpu_type))
    return tuple(sorted(out))


def open_gpus_at(windows: tuple[Window, ...], time_s: float) -> int:
    """GPUs of the windows open at ``time_s`` (``start_s <= time_s < end_s``)."""
    return sum(w.num_gpus for w in windows if w.start_s <= time_s < w.end_s)


def clip_windows(
    windows: tuple[Window, ...], offset_s: float, duration_s: float, max_gpus: int | None
) -> tuple[Window, ...]:
    """Trace windows moved to run time (trace ``offset_s`` is run time 0), those that open
    during the run (or are open at its start), and capped: windows that would open more
    than ``max_gpus`` at once are dropped. A window open at the run's end keeps its own
    end, after the run: the run's end is not its owner reclaiming it (clipped there, every
    window open at the end would be warned of a reclaim ``grace_s`` before it)."""
    out: list[Window] = []
    for w in sorted(windows):
        start_s, end_s = max(w.start_s - offset_s, 0.0), w.end_s - offset_s
        if end_s <= start_s or start_s >= duration_s:
            continue
        clipped = Window(start_s, end_s, w.num_gpus, w.gpu_type)
        open_now = sum(o.num_gpus for o in out if o.start_s <= start_s < o.end_s)
        if max_gpus is not None and open_now + w.num_gpus > max_gpus:
            continue
        out.append(clipped)
    return tuple(out)
