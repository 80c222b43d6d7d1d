"""What one simulated run measured, and the GPU-time accounting behind it.

``GpuClock`` integrates piecewise-constant GPU counts over the virtual clock (elastic
GPUs held, trainer GPUs lent). ``RunMetrics`` is the per-run result that ``pearl
simulate`` averages over seeds; every field's unit is in its name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class GpuClock:
    """Integral of a GPU count over time, in GPU-seconds."""

    count: int = 0
    since_s: float = 0.0
    gpu_s: float = 0.0

    def set(self, now_s: float, count: int) -> None:
        self.gpu_s += self.count * (now_s - self.since_s)
        self.count, self.since_s = count, now_s

    def add(self, now_s: float, delta: int) -> None:
        self.set(now_s, self.count + delta)

    def total_s(self, now_s: float) -> float:
        return self.gpu_s + self.count * (now_s - self.since_s)


@dataclass(frozen=True)
class RunMetrics:
    policy: str
    seed: int
    duration_s: float
    trajectories: int  # finished in the run
    unfinished: int  # started and still running at the end (reported, not lost)
    output_tokens: int
    train_steps: int
    gpu_hours_base: float
    gpu_hours_borrowed: float
    gpu_hours_elastic: float
    batch_times_s: tuple[float, ...]
    transitions: int  # executed non-empty transition plans
    max_trainer_wait_s: float  # longest wait of the trainer for its lent GPUs
    decisions: int
    num_events: int
    predictions: tuple[tuple[float, float], ...] = field(default=())  # (predicted, actual)

    @property
    def hours(self) -> float:
        return self.duration_s / 3600.0

    def summary(self) -> dict[str, Any]:
        """The figures ``pearl simulate --json`` reports per policy (before averaging)."""
        gpu_h = self.gpu_hours_base + self.gpu_hours_elastic
        times = np.asarray(self.batch_times_s) if self.batch_times_s else np.asarray([np.nan])
        return {
            "throughput_traj_per_h": self.trajectories / self.hours,
            "tokens_per_s": self.output_tokens / self.duration_s,
            "train_steps_per_h": self.train_steps / self.hours,
            "gpu_hours": {
                "base": self.gpu_hours_base,
                "borrowed": self.gpu_hours_borrowed,
                "elastic": self.gpu_hours_elastic,
            },
            "traj_per_gpu_hour": self.trajectories / gpu_h if gpu_h else 0.0,
            "batch_time_s": {
                "mean": float(np.mean(times)),
                "p99": float(np.percentile(times, 99)),
            },
            "transitions": self.transitions,
            "max_trainer_wait_s": self.max_trainer_wait_s,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
