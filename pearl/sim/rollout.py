"""Trajectories of an asynchronous rollout: batches, staleness, turns and their requests.

Trajectory ``j`` (numbered from 0 in the seeded stream) belongs to batch ``j // B``. The
trainer consumes batch ``b`` to make policy version ``initial + b + 1``; batch ``b`` may
start once the engines' newest version is at least ``initial + b - k`` (k = staleness), so
with k = 1 one batch is generated ahead of the update that will consume it (ROLL's
``async_generation_ratio: 1``). Trajectories start in order, as soon as their batch may.

A turn is one request: its prompt is the context so far (prompt, every earlier output
and every observation up to this turn), its output the turn's sampled length. A request
taken off an instance (drain, migration, a reclaimed node) continues elsewhere as a new request
whose prompt includes the tokens generated so far: nothing is lost or generated twice.

Invariants: every started trajectory is finished or still tracked here (``in_flight``);
``min_version`` is the oldest policy version whose engine generated any of its tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pearl.core.workload import TrajectoryProgress, TrajPhase, TurnStats, WorkloadSnapshot
from pearl.serving.requests import Request
from pearl.sim.trajectories import TrajectoryModel, TrajectorySpec, sample_trajectories

_CHUNK = 256  # trajectories drawn from the seeded stream at a time
MIN_OBSERVED = 32  # turns observed before the run's own statistics replace the defaults


@dataclass
class Trajectory:
    traj_id: str
    batch_id: int
    spec: TrajectorySpec
    started_s: float
    turn: int = 0
    context_tokens: int = 0  # prompt of the current turn (tokens generated so far excluded)
    generated_tokens: int = 0  # of the current turn, on instances it has left
    phase: TrajPhase = TrajPhase.QUEUED
    env_started_s: float = 0.0
    min_version: int = 1 << 30
    num_requests: int = 0

    @property
    def index(self) -> int:
        """Position in the run's stream (trajectories start in this order)."""
        return int(self.traj_id[1:])

    def next_request(self) -> Request:
        self.num_requests += 1
        rid = f"{self.traj_id}.{self.turn}.{self.num_requests}"
        out = self.spec.output_tokens[self.turn] - self.generated_tokens
        return Request(rid, self.traj_id, self.context_tokens + self.generated_tokens, out)


@dataclass
class BatchRecord:
    batch_id: int
    started_s: float | None = None
    completed_s: float | None = None
    finished: int = 0
    predicted_s: float | None = None


@dataclass
class Rollout:
    """The seeded trajectory stream and every trajectory started from it."""

    model: TrajectoryModel
    rng: np.random.Generator
    batch_size: int
    staleness_versions: int
    initial_version: int
    max_context_tokens: int
    mean_env_s: float  # the model's mean tool latency, until the run has observed some
    in_flight: dict[str, Trajectory] = field(default_factory=dict)
    batches: dict[int, BatchRecord] = field(default_factory=dict)
    num_started: int = 0
    num_finished: int = 0
    output_tokens: int = 0
    turns_done: int = 0
    sum_output_tokens: int = 0
    sum_observation_tokens: int = 0
    sum_env_s: float = 0.0
    sumsq_output_tokens: float = 0.0
    sumsq_env_s: float = 0.0
    env_steps: int = 0
    sum_turns: int = 0  # of finished trajectories
    sumsq_turns: int = 0
    _stream: Iterator[TrajectorySpec] | None = None

    def startable(self, engine_version: int) -> int:
        """How many more trajectories may start with the engines at ``engine_version``."""
        last_batch = engine_version - self.initial_version + self.staleness_versions
        return max(0, (last_batch + 1) * self.batch_size - self.num_started)

    def start(self, now_s: float) -> Trajectory:
        if self._stream is None:
            self._stream = trajectory_stream(self.model, self.rng, self.max_context_tokens)
        spec = next(self._stream)
        j = self.num_started
        self.num_started += 1
        traj = Trajectory(f"t{j:07d}", j // self.batch_size, spec, now_s)
        traj.context_tokens = spec.prompt_tokens
        self.in_flight[traj.traj_id] = traj
        batch = self.batches.setdefault(traj.batch_id, BatchRecord(traj.batch_id))
        if batch.started_s is None:
            batch.started_s = now_s
        return traj

    def turn_generated(self, traj: Trajectory, num_tokens: int, version: int) -> None:
        """Tokens of the current turn generated on an instance it is leaving or has left."""
        traj.generated_tokens += num_tokens
        if num_tokens:
            traj.min_version = min(traj.min_version, version)

    def finish_turn(self, traj: Trajectory, now_s: float, version: int) -> float | None:
        """The turn's output is complete: the tool's end time, or None if it was the last."""
        out = traj.spec.output_tokens[traj.turn]
        traj.min_version = min(traj.min_version, version)
        traj.context_tokens += out
        traj.generated_tokens = 0
        self.output_tokens += out
        self.turns_done += 1
        self.sum_output_tokens += out
        self.sumsq_output_tokens += out * out
        if traj.turn + 1 == traj.spec.num_turns:
            return None
        latency_s = traj.spec.tool_latency_s[traj.turn]
        self.sum_env_s += latency_s
        self.sumsq_env_s += latency_s * latency_s
        self.env_steps += 1
        traj.turn += 1
        new = traj.spec.new_tokens[traj.turn]
        self.sum_observation_tokens += new
        traj.context_tokens += new
        traj.phase = TrajPhase.ENV
        traj.env_started_s = now_s
        return now_s + latency_s

    def finish(self, traj: Trajectory, now_s: float) -> BatchRecord:
        del self.in_flight[traj.traj_id]
        self.num_finished += 1
        self.sum_turns += traj.spec.num_turns
        self.sumsq_turns += traj.spec.num_turns**2
        batch = self.batches[traj.batch_id]
        batch.finished += 1
        if batch.finished == self.batch_size:
            batch.completed_s = now_s
        return batch

    def snapshot(
        self, now_s: float, engine_version: int, turns_left: tuple[float, ...]
    ) -> WorkloadSnapshot:
        """The unfinished trajectories as the predictor sees them (not-started ones counted)."""
        mean_env_s = self.sum_env_s / self.env_steps if self.env_steps else self.mean_env_s
        progress = [
            self._progress(t, now_s, turns_left, mean_env_s) for t in self.in_flight.values()
        ]
        return WorkloadSnapshot(
            trajectories=tuple(progress),
            not_started=self.startable(engine_version),
            stats=self.turn_stats(),
        )

    def turn_stats(self) -> TurnStats | None:
        """What the run observed so far: per-turn means once 32 turns have ended, and the
        spreads once 32 tool calls and 16 trajectories have (the straggler estimate)."""
        n = self.turns_done
        if n < MIN_OBSERVED:
            return None
        spread = self.env_steps >= MIN_OBSERVED and self.num_finished >= MIN_OBSERVED // 2
        return TurnStats(
            output_tokens_per_turn=self.sum_output_tokens / n,
            observation_tokens_per_turn=self.sum_observation_tokens / max(self.env_steps, 1),
            env_latency_s=self.sum_env_s / max(self.env_steps, 1),
            output_tokens_sd=_sd(self.sum_output_tokens, self.sumsq_output_tokens, n)
            if spread
            else None,
            env_latency_sd_s=_sd(self.sum_env_s, self.sumsq_env_s, self.env_steps)
            if spread
            else None,
            turns_cv=_sd(self.sum_turns, self.sumsq_turns, self.num_finished)
            / (self.sum_turns / self.num_finished)
            if spread
            else None,
        )

    @staticmethod
    def _progress(
        t: Trajectory, now_s: float, turns_left: tuple[float, ...], mean_env_s: float
    ) -> TrajectoryProgress:
        # What a coordinator knows: the turns a trajectory has done and for how long its
        # tool has run, not its sampled future. Turns left (the current one included; in
        # env, those after the tool): their expectation given the turns done; tool time
        # left: the mean less the time spent (at least 0).
        remaining = turns_left[t.turn] if t.turn < len(turns_left) else 1.0
        env_s = 0.0
        if t.phase is TrajPhase.ENV:
            env_s = max(mean_env_s - (now_s - t.env_started_s), 0.0)
        return TrajectoryProgress.model_construct(
            traj_id=t.traj_id,
            phase=t.phase,
            context_tokens=t.context_tokens + t.generated_tokens,
            remaining_turns=remaining,
            turn_output_tokens=t.generated_tokens,
            env_remaining_s=env_s,
        )


def trajectory_stream(
    model: TrajectoryModel, rng: np.random.Generator, max_context_tokens: int
) -> Iterator[TrajectorySpec]:
    """The run's trajectories in order, drawn in chunks; prompts clipped so that a whole
    trajectory fits the model's context. The same generator state gives the same stream."""
    while True:
        for spec in sample_trajectories(model, rng, _CHUNK):
            excess = spec.total_tokens - max_context_tokens
            if excess > 0:
                prompt = max(1, spec.prompt_tokens - excess)
                spec = TrajectorySpec(
                    prompt, spec.new_tokens, spec.output_tokens, spec.tool_latency_s
                )
            yield spec


def _sd(total: float, total_sq: float, n: int) -> float:
    mean = total / n
    return float(np.sqrt(max(total_sq / n - mean * mean, 0.0)))
