"""The simulator's workload model: multi-turn agentic trajectories fitted to public traces.

Pure: no I/O, no clock; randomness only from the ``numpy.random.Generator`` passed in. The
trace files are read by the shell (``pearl.io.traces``), which hands plain arrays to
``fit_trajectory_model``.

A trajectory (``TrajectorySpec``) is a prompt followed by ``num_turns`` turns. Before turn
``i`` the environment appends ``new_tokens[i]`` observation tokens (``new_tokens[0] == 0``:
the prompt is the first turn's input); turn ``i`` generates ``output_tokens[i]`` tokens;
after every turn but the last the tool runs for ``tool_latency_s[i]`` seconds. So the
context of turn ``i`` is ``prompt + sum(new[:i+1]) + sum(output[:i])``, which is exactly the
TraceLab relation ``prefix_len[i] = prefix_len[i-1] + input_len[i-1] + output_len[i-1]``
(true for all 255 consecutive round pairs of ``replay_multi_session_large.csv``).

Sources and choices (each component is an ``EmpiricalTail``, see ``distributions.py``):

- ``num_turns``: rounds per session of TraceLab ``replay_multi_session_large.csv`` (48
  sessions, 3-9 rounds), resampled as is: the count is bounded, so no tail is fitted.
- ``observation_tokens``: tokens appended before each turn after the first: TraceLab
  ``input_len`` of rounds >= 1 (multi-session file) and ``newly_append_tokens`` of rounds
  >= 1 of ``sanitized_round_trace.jsonl`` (real coding-agent rounds, pooled as they are).
- ``prompt_tokens``: Azure ``ContextTokens`` pooled with Mooncake ``input_length``: short
  chat prompts and long-context Kimi requests, the two regimes an agent's prompt spans.
- ``output_tokens``: Azure ``GeneratedTokens`` pooled with Mooncake ``output_length``.
- ``tool_latency_s``: SWE-agent step ``execution_time`` (a sandbox action) pooled with the
  per-round tool wall time of TraceLab ``sanitized_round_trace.jsonl`` (first tool call to
  last tool result, since a round's tools can overlap; rounds without tools are left out).
  The multi-session file's ``tool_wait_after_ms`` is not used: its 255 non-final values
  lie between 51 and 599 ms, spread about evenly (100-ms bins: 17, 55, 40, 60, 45, 38), and
  its arrival times are synthetic per its README, so they look generated, not measured.
- Turns, observations, outputs and latencies are drawn independently of each other and of
  the turn index: the traces are too small (303 rounds) to fit a dependence reliably.

Token counts are rounded to integers >= 1 after drawing (the rounding moves a mean by at
most half a token). ``scaled`` moves the means (for scenarios) by multiplying each length
and latency distribution by one factor, which keeps every quantile ratio (the shape), and
the number of turns by ``turns = 1 + stochastic_round((n - 1) * f)`` with ``n`` drawn from
the data, which keeps the mean exact and every trajectory at least one turn.

Invariants (asserted in ``tests/sim/test_trajectories.py``): the same model, seed and ``n``
give identical specs; ``len(new_tokens) == len(output_tokens) == num_turns >= 1``,
``new_tokens[0] == 0``, ``len(tool_latency_s) == num_turns - 1``; means of large samples
match ``means(model)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pearl.core.profile import WorkloadDefaults
from pearl.rollout.observed import turns_left_table as table_of_probs
from pearl.sim.distributions import (
    EmpiricalTail,
    fit_distribution,
    mean_of,
    rescaled,
    sample,
)


@dataclass(frozen=True)
class TrajectorySpec:
    """One sampled trajectory; see the module docstring for the per-turn layout."""

    prompt_tokens: int
    new_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    tool_latency_s: tuple[float, ...]

    @property
    def num_turns(self) -> int:
        return len(self.output_tokens)

    @property
    def total_tokens(self) -> int:
        """Context length at the end: prompt, every observation and every output."""
        return self.prompt_tokens + sum(self.new_tokens) + sum(self.output_tokens)


@dataclass(frozen=True)
class TrajectoryModel:
    """Distributions of one trajectory's parts; build with ``fit_trajectory_model``.

    ``turns_observed`` are the observed turn counts; ``turns_factor`` scales the turns
    beyond the first (1.0 = as observed).
    """

    turns_observed: tuple[int, ...]
    prompt_tokens: EmpiricalTail
    observation_tokens: EmpiricalTail
    output_tokens: EmpiricalTail
    tool_latency_s: EmpiricalTail
    turns_factor: float = 1.0


def fit_trajectory_model(
    *,
    turns_per_session: ArrayLike,
    prompt_tokens: ArrayLike,
    observation_tokens: ArrayLike,
    output_tokens: ArrayLike,
    tool_latency_s: ArrayLike,
) -> TrajectoryModel:
    """Fit each component by the body-and-tail rule; inputs are plain observation arrays."""
    turns = np.asarray(turns_per_session, dtype=np.int64).ravel()
    if turns.size == 0 or np.any(turns < 1):
        raise ValueError("turns_per_session must be non-empty and every count >= 1")
    return TrajectoryModel(
        turns_observed=tuple(int(t) for t in turns),
        prompt_tokens=fit_distribution(prompt_tokens),
        observation_tokens=fit_distribution(observation_tokens),
        output_tokens=fit_distribution(output_tokens),
        tool_latency_s=fit_distribution(tool_latency_s),
    )


def mean_turns(model: TrajectoryModel) -> float:
    """Exact mean of the sampled number of turns."""
    return 1.0 + (float(np.mean(model.turns_observed)) - 1.0) * model.turns_factor


def turns_left_table(model: TrajectoryModel) -> tuple[float, ...]:
    """``E[T - k | T > k]`` for k = 0 .. max(T) - 1: the turns a trajectory that has
    done ``k`` turns can expect to have left, from the exact distribution of sampled
    turn counts (what a coordinator knows of its task from earlier runs), by
    ``pearl.rollout.observed.turns_left_table``."""
    probs: dict[int, float] = {}
    weight = 1.0 / len(model.turns_observed)
    for observed in model.turns_observed:
        extra = (observed - 1) * model.turns_factor
        whole = math.floor(extra)
        for turns, p in ((1 + whole, 1.0 - (extra - whole)), (2 + whole, extra - whole)):
            if p > 0:
                probs[turns] = probs.get(turns, 0.0) + weight * p
    return table_of_probs(probs)


def means(model: TrajectoryModel) -> WorkloadDefaults:
    """The model's means in the profile's terms (before rounding tokens to integers)."""
    return WorkloadDefaults(
        prompt_tokens=mean_of(model.prompt_tokens),
        output_tokens_per_turn=mean_of(model.output_tokens),
        observation_tokens_per_turn=mean_of(model.observation_tokens),
        env_latency_s=mean_of(model.tool_latency_s),
        turns_per_trajectory=mean_turns(model),
    )


def scaled(
    model: TrajectoryModel,
    *,
    prompt_tokens: float | None = None,
    output_tokens_per_turn: float | None = None,
    observation_tokens_per_turn: float | None = None,
    env_latency_s: float | None = None,
    turns_per_trajectory: float | None = None,
) -> TrajectoryModel:
    """The model with the given means (``None`` keeps one) and the same shapes."""
    out = model
    if prompt_tokens is not None:
        out = replace(out, prompt_tokens=rescaled(out.prompt_tokens, prompt_tokens))
    if output_tokens_per_turn is not None:
        out = replace(out, output_tokens=rescaled(out.output_tokens, output_tokens_per_turn))
    if observation_tokens_per_turn is not None:
        obs = rescaled(out.observation_tokens, observation_tokens_per_turn)
        out = replace(out, observation_tokens=obs)
    if env_latency_s is not None:
        out = replace(out, tool_latency_s=rescaled(out.tool_latency_s, env_latency_s))
    if turns_per_trajectory is not None:
        observed_extra = float(np.mean(model.turns_observed)) - 1.0
        if turns_per_trajectory < 1.0:
            raise ValueError(f"turns_per_trajectory must be >= 1, got {turns_per_trajectory}")
        if observed_extra <= 0.0:
            raise ValueError("every observed trajectory has one turn; cannot scale turns")
        out = replace(out, turns_factor=(turns_per_trajectory - 1.0) / observed_extra)
    return out


def _tokens(d: EmpiricalTail, rng: np.random.Generator, size: int) -> NDArray[np.int64]:
    return np.maximum(np.rint(sample(d, rng, size)), 1).astype(np.int64)


def _turns(model: TrajectoryModel, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
    observed = np.asarray(model.turns_observed, dtype=np.int64)
    extra = (observed[rng.integers(0, observed.size, n)] - 1) * model.turns_factor
    whole = np.floor(extra)
    turns: NDArray[np.int64] = (1 + whole + (rng.random(n) < extra - whole)).astype(np.int64)
    return turns


def sample_trajectories(
    model: TrajectoryModel, rng: np.random.Generator, n: int
) -> list[TrajectorySpec]:
    """``n`` independent trajectories; deterministic for a given ``rng`` state."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    turns = _turns(model, rng, n)
    total_turns = int(turns.sum())
    prompts = _tokens(model.prompt_tokens, rng, n)
    outputs = _tokens(model.output_tokens, rng, total_turns)
    news = _tokens(model.observation_tokens, rng, total_turns)
    latencies = sample(model.tool_latency_s, rng, total_turns)
    specs: list[TrajectorySpec] = []
    start = 0
    for i in range(n):
        end = start + int(turns[i])
        specs.append(
            TrajectorySpec(
                prompt_tokens=int(prompts[i]),
                new_tokens=(0, *(int(t) for t in news[start + 1 : end])),
                output_tokens=tuple(int(t) for t in outputs[start:end]),
                tool_latency_s=tuple(float(t) for t in latencies[start : end - 1]),
            )
        )
        start = end
    return specs
