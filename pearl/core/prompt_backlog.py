"""The prompt backlog: fresh trajectories' first prefills, queued at the prefill pool.

A *fresh* trajectory (not started, or listed as queued for its first turn) has none of
its context cached anywhere, so its first prefill computes its whole prompt. The turn
cycle (``turn_model``) charges every turn the new tokens of a returning one (``n``: the
observation, plus the output when disaggregated) after a cached prefix, so the fresh
prompts' remaining ``P - n`` tokens are work the fluid does not see. When many fresh
trajectories arrive at once (a batch's groups admitted after an update), that work is a
backlog at the prefill pool ahead of every turn that reaches the pool after it (vLLM's
scheduler takes waiting requests first come, first served).

Model (``docs/predictor.md``, "The prompt backlog"): each prefill-capable group ``g``
would compute the whole backlog alone in
``X_g = h (b_g S1 + c_g S2 + a_g S1 / max_batched_tokens_g) / count_g`` seconds
(``S1 = sum (P - n)``, ``S2 = sum (P - n)^2`` over the fresh trajectories with ``P > n``; ``h``
the prefix hit share of the first segment, since the cycle already charges a miss the
whole context); the pool shares it in proportion to speed, so it clears in
``D = 1 / sum_g (1 / X_g)``. A turn reaching the pool at a uniform point of the first cycle
``T`` waits until the backlog clears: on average ``D^2 / (2T)`` when ``D <= T`` and
``D - T/2`` beyond. The batch completes that mean later, times the share of the
trajectories whose next turn comes before the batch completes (``reach_share``: all of
them once the batch takes a cycle ``T``, else its share of ``T``); the whole workload
completes no earlier than its critical path plus ``D`` (the last fresh prompt starts at
``D``; a next batch of fewer than all groups is taken to be of groups already running,
so not for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pearl.core.engine_groups import EngineGroups, TurnShape

F64 = NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class FreshPrompts:
    """The prompts of the fresh trajectories, and per PD mode (colocated, disaggregated)
    the sums over them of ``x = max(P - n, 0)`` and ``x^2``, ``n`` a returning turn's new
    tokens in that mode (what the prefill's linear and attention terms need)."""

    prompt_tokens: F64
    beyond: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))

    @property
    def count(self) -> int:
        return len(self.prompt_tokens)

    @staticmethod
    def of(prompt_tokens: F64, turn: TurnShape) -> FreshPrompts:
        p = np.asarray(prompt_tokens, dtype=np.float64)
        sums = []
        for new in (turn.observation_tokens, turn.observation_tokens + turn.output_tokens):
            x = np.maximum(p - new, 0.0)
            sums.append((float(x.sum()), float((x * x).sum())))
        return FreshPrompts(p, (sums[0], sums[1]))


NO_FRESH_PROMPTS = FreshPrompts(np.zeros(0))


def backlog_s(g: EngineGroups, fresh: FreshPrompts, hit: F64) -> F64:
    """Per configuration, (C, 1): seconds for the prefill pool to clear the backlog.

    ``hit``: the prefix hit share of each configuration's first segment, (C, 1).
    """
    if fresh.count == 0:
        return np.zeros((g.num_configs, 1))
    (s1_col, s2_col), (s1_dis, s2_dis) = fresh.beyond
    s1 = np.where(g.disaggregated, s1_dis, s1_col)
    s2 = np.where(g.disaggregated, s2_dis, s2_col)
    s1_r, s2_r, hit_r = g.pf_spread(s1), g.pf_spread(s2), g.pf_spread(hit)
    per_instance_s = g.pf_b_s * s1_r + g.pf_c_s * s2_r
    per_instance_s += g.pf_a_s * s1_r / np.maximum(g.pf_max_batched_tokens, 1.0)
    group_s = hit_r * per_instance_s / g.pf_count  # the group alone clears it in this
    rate = g.pf_sum(np.where(group_s > 0, 1.0 / np.maximum(group_s, 1e-300), np.inf))
    result: F64 = np.where(np.isfinite(rate) & (rate > 0), 1.0 / rate, 0.0)
    return result


def mean_wait_s(backlog: F64, cycle_s: F64) -> F64:
    """The mean wait of a turn reaching the pool at a uniform point of a cycle of
    ``cycle_s`` behind a backlog that clears at ``backlog``: D^2 / 2T, or D - T/2."""
    t = np.maximum(cycle_s, 1e-300)
    result: F64 = np.where(backlog <= t, backlog * backlog / (2.0 * t), backlog - 0.5 * t)
    return result


def reach_share(completion_s: F64, cycle_s: F64) -> F64:
    """The share of the trajectories whose next turn reaches the pool before a batch
    completing at ``completion_s`` does: all of them once it takes a cycle, else the
    share of a cycle it takes (a turn is at a uniform point of its cycle). A batch a
    moment from completing waits for no prompt: its members' last prefills are done."""
    result: F64 = np.minimum(completion_s / np.maximum(cycle_s, 1e-300), 1.0)
    return result
