"""What the predictor observes of a rollout (pearl.rollout.observed), on hand-computed cases:
the turn statistics and when they start, a running tool's time left, the turns left from
finished trajectories, one trajectory's progress and the snapshot under both batchings."""

from __future__ import annotations

import pytest

from pearl.core.workload import NextBatch, TrajPhase
from pearl.rollout.ledger import RolloutLedger
from pearl.rollout.observed import (
    MIN_OBSERVED,
    TurnObserver,
    progress,
    snapshot,
    turns_left_table,
)
from pearl.rollout.rules import Batching, RolloutRules


def _observer(turns: int, env_steps: int, finished: dict[int, int]) -> TurnObserver:
    """Turns of 10 and 30 output tokens in turn; tool steps of 1 s and 3 s in turn, each
    appending 5 tokens; ``finished``: trajectories finished, by their turn counts, each of
    a prompt of 100 tokens per turn."""
    obs = TurnObserver()
    for i in range(turns):
        obs.turn_ended(10 if i % 2 == 0 else 30)
    for i in range(env_steps):
        obs.env_step(1.0 if i % 2 == 0 else 3.0, 5)
    for num_turns, count in finished.items():
        for _ in range(count):
            obs.trajectory_finished(num_turns, 100 * num_turns)
    return obs


def test_turn_stats_none_before_32_turns() -> None:
    assert MIN_OBSERVED == 32
    assert _observer(31, 31, {1: 8, 3: 8}).turn_stats() is None


def test_turn_stats_means_at_32_turns_spreads_once_32_steps_and_16_finished() -> None:
    means_only = _observer(32, 31, {1: 8, 3: 8}).turn_stats()
    assert means_only is not None and not means_only.has_spread
    assert means_only.output_tokens_per_turn == 20.0
    assert means_only.observation_tokens_per_turn == 5.0
    assert means_only.env_latency_s == 61.0 / 31  # 16 x 1 s + 15 x 3 s
    fifteen_finished = _observer(32, 32, {1: 8, 3: 7}).turn_stats()
    assert fifteen_finished is not None and not fifteen_finished.has_spread

    stats = _observer(32, 32, {1: 8, 3: 8}).turn_stats()
    assert stats is not None and stats.has_spread
    assert stats.output_tokens_per_turn == 20.0  # 10 and 30: mean 20, sd 10
    assert stats.output_tokens_sd == 10.0
    assert stats.env_latency_s == 2.0  # 1 s and 3 s: mean 2, sd 1
    assert stats.env_latency_sd_s == 1.0
    assert stats.observation_tokens_per_turn == 5.0
    assert stats.turns_cv == 0.5  # 1 and 3 turns: mean 2, sd 1
    assert stats.turns_observed == 32  # what the output mean is of


def test_no_tool_step_observed() -> None:
    obs = _observer(32, 0, {})
    stats = obs.turn_stats()
    assert stats is not None
    assert stats.observation_tokens_per_turn == 0.0 and stats.env_latency_s == 0.0
    assert obs.mean_env_s(7.5) == 7.5
    assert _observer(0, 3, {}).mean_env_s(7.5) == 5.0 / 3  # 1 + 3 + 1 s


def test_tool_left_the_default_mean_until_32_calls() -> None:
    left = _observer(0, 31, {}).tool_left(10.0)
    assert left(0.0) == 10.0 and left(3.0) == 7.0 and left(12.0) == 0.0


def test_tool_left_the_mean_of_the_longer_latencies() -> None:
    obs = TurnObserver()
    for _ in range(8):
        for latency_s in (4.0, 1.0, 3.0, 2.0):
            obs.env_step(latency_s, 0)
    left = obs.tool_left(100.0)
    assert left(0.0) == 2.5  # all four: (1 + 2 + 3 + 4) / 4
    assert left(1.0) == 2.0  # 2, 3, 4 s: 3 s mean, less the 1 s spent
    assert left(2.0) == 1.5  # 3 and 4 s: 3.5 s mean, less 2 s
    assert left(2.5) == 1.0
    assert left(3.9) == pytest.approx(0.1)  # only the 4 s calls
    assert left(4.0) == 0.0 and left(9.0) == 0.0  # longer than any observed


def test_turns_left_table_by_hand() -> None:
    # T = 1 or 3, equally: k=0 -> (1 + 3) / 2; k=1 -> only 3: 3 - 1; k=2 -> 3 - 2
    assert turns_left_table({1: 0.5, 3: 0.5}) == (2.0, 2.0, 1.0)
    # T = 2 (3/4) or 5 (1/4): k=0 -> 2*3/4 + 5/4; k=1 -> 1*3/4 + 4/4; then only 5
    assert turns_left_table({2: 0.75, 5: 0.25}) == (2.75, 1.75, 3.0, 2.0, 1.0)
    assert turns_left_table({2: 3.0, 5: 1.0}) == (2.75, 1.75, 3.0, 2.0, 1.0)  # unnormalized


def test_turns_left_from_finished_trajectories_once_16() -> None:
    default = (9.0, 8.0)
    assert _observer(0, 0, {1: 8, 3: 7}).turns_left(default) == default
    assert _observer(0, 0, {3: 8, 1: 8}).turns_left(default) == (2.0, 2.0, 1.0)
    assert _observer(0, 0, {5: 4, 2: 12}).turns_left(default) == (2.75, 1.75, 3.0, 2.0, 1.0)


def test_a_not_started_trajectory_is_of_the_finished_ones_mean_prompt_and_turns() -> None:
    """The profile's defaults (None) until 16 have finished; then their means, the turns
    unless the caller knows them from its turn-count table."""
    ledger = RolloutLedger(RolloutRules(batch_trajectories=4, max_staleness_versions=0))
    assert snapshot(ledger, [], _observer(0, 0, {1: 8, 3: 7}), version=0).not_started_turns is None
    observer = _observer(0, 0, {1: 8, 3: 8})  # prompts of 100 and 300 tokens
    assert observer.mean_turns() == 2.0 and observer.mean_prompt_tokens() == 200.0
    seen = snapshot(ledger, [], observer, version=0)
    assert seen.not_started_turns == 2.0 and seen.not_started_prompt_tokens == 200.0
    told = snapshot(ledger, [], observer, version=0, not_started_turns=6.5)
    assert told.not_started_turns == 6.5 and told.not_started_prompt_tokens == 200.0


def _raises(_: float) -> float:
    raise AssertionError("tool_left asked outside the env phase")


def test_progress_in_env() -> None:
    p = progress("t0", TrajPhase.ENV, 120, 0, 1, 2.0, "g0", (3.0, 2.0, 1.0), lambda a: 5.0 - a)
    assert p.traj_id == "t0" and p.phase is TrajPhase.ENV and p.group_id == "g0"
    assert p.context_tokens == 120 and p.turn_output_tokens == 0
    assert p.remaining_turns == 2.0  # turns_left[1]: one turn done
    assert p.env_remaining_s == 3.0  # tool_left(2 s run)


def test_progress_in_decode_and_beyond_the_table() -> None:
    table = (3.0, 2.0, 1.0)
    p = progress("t1", TrajPhase.DECODE, 150, 30, 1, 99.0, None, table, _raises)
    assert p.phase is TrajPhase.DECODE and p.group_id is None
    assert p.context_tokens == 150 and p.turn_output_tokens == 30
    assert p.remaining_turns == 2.0 and p.env_remaining_s == 0.0
    assert (
        progress("t1", TrajPhase.QUEUED, 10, 0, 3, 0.0, None, table, _raises).remaining_turns == 1.0
    )


@pytest.mark.parametrize("batching", list(Batching))
def test_snapshot_of_a_small_ledger(batching: Batching) -> None:
    """Batches of 2 groups of 2, staleness 0: both groups admitted, the first finished; the
    second runs. Under version 0 nothing more is admitted, under version 1 a batch more."""
    rules = RolloutRules(
        batch_trajectories=4, max_staleness_versions=0, group_size=2, batching=batching
    )
    ledger = RolloutLedger(rules)
    ledger.admit(("t0", "t1"), 0.0)
    ledger.admit(("t2", "t3"), 0.0)
    for traj_id in ("t0", "t1"):
        ledger.sent(traj_id)
        ledger.generated(traj_id, 7, 0)
        ledger.turn_ended(traj_id, 1.0, last=True)
    grouped = batching is Batching.FIRST_COMPLETED
    running = [
        progress(t, TrajPhase.DECODE, 50, 5, 0, 0.0, "g1" if grouped else None, (2.0,), _raises)
        for t in ("t2", "t3")
    ]
    observer = _observer(32, 0, {})
    stats = observer.turn_stats()

    now = snapshot(ledger, running, observer, version=0)
    assert now.not_started == 0 and now.stats == stats
    assert now.not_started_prompt_tokens is None and now.not_started_turns is None
    assert [t.traj_id for t in now.trajectories] == ["t2", "t3"]
    soon = snapshot(ledger, running, observer, version=1, update_left_s=5.0)
    assert soon.not_started == 4  # (0 + 1 + 1) x 4 - (2 finished + 2 running)
    if grouped:
        assert [t.group_id for t in soon.trajectories] == ["g1", "g1"]
        assert soon.next_batch == NextBatch(
            groups_needed=1, group_size=2, not_started_after_s=5.0, groups_per_batch=2
        )
        assert now.next_batch == NextBatch(groups_needed=1, group_size=2, groups_per_batch=2)
        ahead = now.lookahead()  # the batch after the next: two more groups, four more trajectories
        assert ahead is not None and ahead.not_started == now.not_started + 4
        assert ahead.next_batch == NextBatch(groups_needed=3, group_size=2, groups_per_batch=2)
    else:
        assert [t.group_id for t in soon.trajectories] == [None, None]
        assert soon.next_batch is None and now.next_batch is None
