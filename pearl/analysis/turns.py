"""The rollout section of a run: turns, tokens/s and tool latencies of a real rollout.

The rollout manager (``pearl/agents/manager.py``) logs every model turn (``turn_ended``),
every lost trajectory (``trajectory_lost``) and, on ``trajectory_finished``, its reward
and why it ended. ``RolloutTurns`` accumulates them in the one streaming pass of
``pearl.analysis.runs``; ``summary`` is ``None`` for a log without turn or lost records
(the simulator's and the coordinator's), so their summaries keep no rollout section.

Figures (``docs/analysis.md``, "Rollout"): output tokens per second over the span from
the first turn's send (``started_t``) to the last turn's end (``t``); model-turn latency
``t - started_t`` and tool latency ``env_s`` (turns followed by a tool step) as mean,
p50, p90, p99 (numpy's linear percentile) and max; turns per finished trajectory
(``num_turns``); end reasons, mean reward; the shares of turns resubmitted after an
abort (``continuations > 0``), prefilled remotely (``prefilled_by`` not empty) and
served by more than one instance (migrated).

Memory: two 8-byte floats per turn (the latencies, for exact percentiles) and one int
per finished trajectory; counters otherwise.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pearl.analysis.metrics import Handlers, rounded
from pearl.runlog.schema import TrajectoryFinished, TrajectoryLost, TurnEnded

NO_END_REASON = "unspecified"  # trajectory_finished without end_reason (not logged)


def spread(values: array[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (numpy's linear percentile) and max; ``None`` each when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": rounded(float(np.mean(a))),
        "p50": rounded(float(p50)),
        "p90": rounded(float(p90)),
        "p99": rounded(float(p99)),
        "max": rounded(float(np.max(a))),
    }


def _share(n: int, of: int) -> float | None:
    return rounded(n / of) if of else None


@dataclass
class RolloutTurns:
    turns: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_started_t: float = math.inf
    last_end_t: float = -math.inf
    model_turn_s: array[float] = field(default_factory=lambda: array("d"))
    tool_s: array[float] = field(default_factory=lambda: array("d"))
    continued_turns: int = 0
    continuations: int = 0
    remote_prefill_turns: int = 0
    migrated_turns: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    finished: int = 0
    turns_per_trajectory: array[float] = field(default_factory=lambda: array("d"))
    end_reasons: Counter[str] = field(default_factory=Counter)
    rewards: int = 0
    reward_sum: float = 0.0
    lost: int = 0
    lost_wasted_tokens: int = 0
    lost_turns_done: int = 0
    lost_reasons: Counter[str] = field(default_factory=Counter)

    def handlers(self) -> Handlers:
        return {
            "turn_ended": self._on_turn,
            "trajectory_finished": self._on_finished,
            "trajectory_lost": self._on_lost,
        }

    def _on_turn(self, r: TurnEnded) -> None:
        self.turns += 1
        self.prompt_tokens += r.prompt_tokens
        self.output_tokens += r.output_tokens
        self.first_started_t = min(self.first_started_t, r.started_t)
        self.last_end_t = max(self.last_end_t, r.t)
        self.model_turn_s.append(max(0.0, r.t - r.started_t))
        if r.env_s is not None:
            self.tool_s.append(r.env_s)
        if r.continuations:
            self.continued_turns += 1
            self.continuations += r.continuations
        if r.prefilled_by:
            self.remote_prefill_turns += 1
        if len(r.served_by) > 1:
            self.migrated_turns += 1
        self.finish_reasons[r.finish_reason or NO_END_REASON] += 1

    def _on_finished(self, r: TrajectoryFinished) -> None:
        self.finished += 1
        self.turns_per_trajectory.append(r.num_turns)
        self.end_reasons[r.end_reason or NO_END_REASON] += 1
        if r.reward is not None:
            self.rewards += 1
            self.reward_sum += r.reward

    def _on_lost(self, r: TrajectoryLost) -> None:
        self.lost += 1
        self.lost_wasted_tokens += r.wasted_tokens
        self.lost_turns_done += r.turns_done
        self.lost_reasons[r.reason] += 1

    @property
    def span_s(self) -> float | None:
        """From the first turn's send to the last turn's end; ``None`` without turns."""
        return self.last_end_t - self.first_started_t if self.turns else None

    def summary(self) -> dict[str, Any] | None:
        """The rollout section, or ``None`` when the log has no turn or lost record."""
        if not self.turns and not self.lost:
            return None
        span = self.span_s
        tpt = spread(self.turns_per_trajectory)
        return {
            "turns": self.turns,
            "trajectories_finished": self.finished,
            "trajectories_lost": self.lost,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "first_turn_started_t": rounded(self.first_started_t) if self.turns else None,
            "last_turn_ended_t": rounded(self.last_end_t) if self.turns else None,
            "span_s": rounded(span),
            "output_tokens_per_s": rounded(self.output_tokens / span) if span else None,
            "turns_per_trajectory": {k: tpt[k] for k in ("mean", "p50", "max")},
            "model_turn_s": spread(self.model_turn_s),
            "tool_s": spread(self.tool_s),
            "tool_steps": len(self.tool_s),
            "end_reasons": dict(sorted(self.end_reasons.items())),
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "rewarded_trajectories": self.rewards,
            "mean_reward": rounded(self.reward_sum / self.rewards) if self.rewards else None,
            "continued_turns": self.continued_turns,
            "continuations": self.continuations,
            "continued_turns_share": _share(self.continued_turns, self.turns),
            "remote_prefill_turns": self.remote_prefill_turns,
            "remote_prefill_share": _share(self.remote_prefill_turns, self.turns),
            "migrated_turns": self.migrated_turns,
            "migrated_share": _share(self.migrated_turns, self.turns),
            "lost_wasted_tokens": self.lost_wasted_tokens,
            "lost_turns_done": self.lost_turns_done,
            "lost_reasons": dict(sorted(self.lost_reasons.items())),
        }
