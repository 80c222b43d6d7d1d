"""What a coordinator's predictor observes of a rollout (pure: no I/O, no clock, no
randomness).

The world (the simulator's ``pearl.sim.rollout``, the rollout manager's real trajectories)
reports each completed turn, each tool step and each finished trajectory to a
``TurnObserver``; from those counts come the run's turn statistics (``turn_stats``), a
running tool call's expected time left (``tool_left``) and the turns a trajectory can
expect to have left (``turns_left``). ``progress`` turns one trajectory's state into the
predictor's ``TrajectoryProgress``, and ``snapshot`` makes the ``WorkloadSnapshot`` of the
rollout ledger's rules (``pearl.rollout.ledger``).

The defaults (the profile's or the workload model's means) hold until ``MIN_OBSERVED``
turns or tool calls, or ``MIN_OBSERVED // 2`` finished trajectories, were observed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pearl.core.workload import (
    NextBatch,
    TrajectoryProgress,
    TrajPhase,
    TurnStats,
    WorkloadSnapshot,
)
from pearl.rollout.ledger import RolloutLedger
from pearl.rollout.rules import Batching

MIN_OBSERVED = 32  # turns observed before the run's own statistics replace the defaults


@dataclass
class TurnObserver:
    """The turn statistics a coordinator observes over a run."""

    turns_done: int = 0  # completed model turns
    sum_output_tokens: int = 0  # of completed turns
    sumsq_output_tokens: float = 0.0
    env_steps: int = 0  # tool steps (after every turn but a trajectory's last)
    sum_env_s: float = 0.0
    sumsq_env_s: float = 0.0
    env_latencies_s: list[float] = field(default_factory=list)  # in the order observed
    sum_observation_tokens: int = 0  # appended after the tool steps
    num_finished: int = 0  # trajectories whose last turn ended
    sum_turns: int = 0  # of finished trajectories
    sumsq_turns: int = 0
    sum_prompt_tokens: int = 0  # of finished trajectories
    turn_counts: dict[int, int] = field(default_factory=dict)  # finished trajectories by turns

    def turn_ended(self, output_tokens: int) -> None:
        """A model turn completed with ``output_tokens`` tokens."""
        self.turns_done += 1
        self.sum_output_tokens += output_tokens
        self.sumsq_output_tokens += output_tokens * output_tokens

    def env_step(self, latency_s: float, observation_tokens: int) -> None:
        """A tool step after a turn that was not its trajectory's last: its latency and the
        observation tokens it appended to the context."""
        self.sum_env_s += latency_s
        self.sumsq_env_s += latency_s * latency_s
        self.env_steps += 1
        self.env_latencies_s.append(latency_s)
        self.sum_observation_tokens += observation_tokens

    def trajectory_finished(self, num_turns: int, prompt_tokens: int) -> None:
        """A trajectory's last turn ended: its turns and the tokens of its prompt."""
        self.num_finished += 1
        self.sum_turns += num_turns
        self.sum_prompt_tokens += prompt_tokens
        self.sumsq_turns += num_turns**2
        self.turn_counts[num_turns] = self.turn_counts.get(num_turns, 0) + 1

    def turn_stats(self) -> TurnStats | None:
        """What the run observed so far: per-turn means once 32 turns have ended, and the
        spreads once 32 tool calls and 16 trajectories have (the straggler estimate), with
        the count of turns the output mean is of (the predictor weighs it against the
        defaults by the turns still running: ``WorkloadSnapshot.turn_stats``)."""
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
            turns_observed=n,
        )

    def mean_prompt_tokens(self) -> float | None:
        """The finished trajectories' mean prompt once 16 have finished, else None."""
        n = self.num_finished
        return self.sum_prompt_tokens / n if n >= MIN_OBSERVED // 2 else None

    def mean_turns(self) -> float | None:
        """The finished trajectories' mean turn count once 16 have finished, else None."""
        n = self.num_finished
        return self.sum_turns / n if n >= MIN_OBSERVED // 2 else None

    def mean_env_s(self, default_s: float) -> float:
        """The observed mean tool latency, or ``default_s`` before any tool step."""
        return self.sum_env_s / self.env_steps if self.env_steps else default_s

    def tool_left(self, default_mean_s: float) -> Callable[[float], float]:
        """A running tool call's expected time left given the time it has run: the mean of
        the observed latencies longer than that, less it (the calls still running are the
        long ones); ``default_mean_s`` less it until 32 calls were observed."""
        if self.env_steps < MIN_OBSERVED:
            return mean_tool_left(default_mean_s)
        lat = np.sort(np.asarray(self.env_latencies_s))
        longer = np.concatenate([np.cumsum(lat[::-1])[::-1], [0.0]])  # sums of lat[k:]

        def left(a: float) -> float:
            k = int(np.searchsorted(lat, a, "right"))
            n = len(lat) - k
            return max(float(longer[k]) / n - a, 0.0) if n else 0.0

        return left

    def turns_left(self, default: tuple[float, ...]) -> tuple[float, ...]:
        """``E[T - k | T > k]`` for k = 0 .. max(T) - 1 from the turn counts of the finished
        trajectories once 16 have finished (``turns_left_table`` of their frequencies);
        ``default`` before."""
        n = self.num_finished
        if n < MIN_OBSERVED // 2:
            return default
        return turns_left_table({t: self.turn_counts[t] / n for t in sorted(self.turn_counts)})


def mean_tool_left(mean_s: float) -> Callable[[float], float]:
    """A running tool call's expected time left given the time it has run: ``mean_s``
    less that time, never below 0."""
    return lambda a: max(mean_s - a, 0.0)


def turns_left_table(probs: Mapping[int, float]) -> tuple[float, ...]:
    """``E[T - k | T > k]`` for k = 0 .. max(T) - 1, the turns a trajectory that has done
    ``k`` turns can expect to have left, from ``probs``: the probability of each turn count
    ``T`` (positive; they need not sum to 1)."""
    table = []
    for k in range(max(probs)):
        beyond = {t: p for t, p in probs.items() if t > k}
        mass = sum(beyond.values())
        table.append(sum((t - k) * p for t, p in beyond.items()) / mass)
    return tuple(table)


def progress(
    traj_id: str,
    phase: TrajPhase,
    context_tokens: int,
    turn_output_tokens: int,
    turns_done: int,
    env_running_s: float,
    group_id: str | None,
    turns_left: tuple[float, ...],
    tool_left: Callable[[float], float],
) -> TrajectoryProgress:
    """One trajectory as a coordinator knows it: the turns it has done and for how long its
    tool has run, not its future. ``context_tokens`` includes the current turn's tokens so
    far (``turn_output_tokens``). Turns left (the current one included; in env, those after
    the tool): ``turns_left[turns_done]``, 1 beyond the table; the tool's time left (in env
    only): ``tool_left(env_running_s)``. Queued for its first turn, it is fresh: nothing of
    it is cached (``TrajectoryProgress.fresh``)."""
    remaining = turns_left[turns_done] if turns_done < len(turns_left) else 1.0
    env_s = tool_left(env_running_s) if phase is TrajPhase.ENV else 0.0
    return TrajectoryProgress.model_construct(
        traj_id=traj_id,
        phase=phase,
        context_tokens=context_tokens,
        remaining_turns=remaining,
        turn_output_tokens=turn_output_tokens,
        env_remaining_s=env_s,
        group_id=group_id,
        fresh=phase is TrajPhase.QUEUED and turns_done == 0,
    )


def snapshot(
    ledger: RolloutLedger,
    progress: Sequence[TrajectoryProgress],
    observer: TurnObserver,
    version: int,
    update_left_s: float = 0.0,
    not_started_turns: float | None = None,
) -> WorkloadSnapshot:
    """The running trajectories (``progress``, with their groups under first-completed
    batches) and the trajectories the ledger admits once the weights are ``version``.

    The observer gives the turn statistics and what a trajectory not begun yet holds: the
    finished ones' mean prompt and, unless ``not_started_turns`` says it (the turn-count
    table the running trajectories' turns left come from), their mean turns; the profile's
    defaults before 16 have finished.

    In-order batches ask for every unfinished trajectory. First-completed batches ask for
    the next batch (``NextBatch``): the groups it still needs when the trainer can take
    it (those the pending update's past-bound rule takes back need completing again:
    ``RolloutLedger.groups_needed_at_take``), and what the running update will admit
    begins ``update_left_s`` from now."""
    rules = ledger.rules
    common = {
        "trajectories": tuple(progress),
        "not_started": ledger.capacity(version),
        "stats": observer.turn_stats(),
        "not_started_prompt_tokens": observer.mean_prompt_tokens(),
        "not_started_turns": not_started_turns or observer.mean_turns(),
    }
    if rules.batching is Batching.IN_ORDER:
        return WorkloadSnapshot(**common)
    needed = ledger.groups_needed_at_take()
    return WorkloadSnapshot(
        **common,
        next_batch=NextBatch(
            groups_needed=needed,
            group_size=rules.group_size,
            not_started_after_s=update_left_s,
            groups_per_batch=rules.groups_per_batch,
        ),
    )


def _sd(total: float, total_sq: float, n: int) -> float:
    mean = total / n
    return float(np.sqrt(max(total_sq / n - mean * mean, 0.0)))
