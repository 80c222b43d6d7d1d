"""The prompt backlog (pearl.core.prompt_backlog): fresh trajectories' whole prompts,
queued at the prefill pool, priced as the simulator's engines compute them.

Before it, a fresh trajectory's first turn was charged a returning turn's few hundred new
tokens, so a burst of admissions (a batch's groups after an update) cost nothing; on the
shipped Qwen3-30B-A3B scenario the predictor then called a configuration with five
prefill instances as fast as 36 colocated ones, while the simulator's turns waited up to
17 s behind the prompts (docs/predictor.md, "The prompt backlog").
"""

from __future__ import annotations

import pytest

from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.predictor import predict, predict_many
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.core.workload import (
    NextBatch,
    TrajectoryProgress,
    TrajPhase,
    TurnStats,
    WorkloadSnapshot,
)
from pearl.io.documents import load_profile
from pearl.serving.requests import Request
from pearl.sim.engine import EngineModel

GPU = "h20"


def config(tp: int = 1, **counts: int) -> PDConfig:
    return PDConfig.of({InstanceSpec(Role(role), GPU, tp): n for role, n in counts.items()})


def burst(num_fresh: int, obs: float = 500.0, out: float = 200.0) -> WorkloadSnapshot:
    stats = TurnStats(
        output_tokens_per_turn=out, observation_tokens_per_turn=obs, env_latency_s=2.0
    )
    return WorkloadSnapshot(not_started=num_fresh, stats=stats)


def simulated_prefill_s(profile: RuntimeProfile, num_prompts: int, prompt_tokens: int) -> float:
    """Seconds the simulator's prefill engine takes for ``num_prompts`` whole prompts."""
    engine = EngineModel.from_profile(Role.PREFILL, profile, GPU, 1)
    for i in range(num_prompts):
        engine.submit(Request(f"r{i}", f"t{i}", prompt_tokens, 1))
    total_s = 0.0
    while engine.has_work:
        total_s += engine.step().duration_s
    return total_s


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b"])
def test_the_backlog_is_what_the_simulated_engine_spends_on_the_prompts(name: str) -> None:
    """With a returning turn of 2 new tokens, the backlog is the whole prompts' prefill:
    on one prefill instance, within 3% of the simulator's engine (the fixed cost per batch
    is spread over the tokens, as the turn cycle does)."""
    profile = load_profile(name)
    prompt = int(profile.workload.prompt_tokens)
    p = predict(burst(64, obs=1.0, out=1.0), config(prefill=1, decode=4), profile)
    assert p.breakdown.prompt_backlog_s == pytest.approx(
        simulated_prefill_s(profile, 64, prompt), rel=0.03
    )


def test_instances_share_the_backlog_and_only_fresh_trajectories_make_one() -> None:
    profile = load_profile("qwen3-30b-a3b")
    one, four = predict_many(
        burst(32), [config(prefill=1, decode=8), config(prefill=4, decode=8)], profile
    )
    assert one.breakdown.prefix_hit_rate == four.breakdown.prefix_hit_rate == 1.0
    assert one.breakdown.prompt_backlog_s == pytest.approx(4 * four.breakdown.prompt_backlog_s)
    started = TrajectoryProgress(
        traj_id="t0", phase=TrajPhase.QUEUED, context_tokens=6000, remaining_turns=3.0
    )
    listed = WorkloadSnapshot(trajectories=(started,))
    assert predict(listed, config(colocated=2), profile).breakdown.prompt_backlog_s == 0.0
    fresh = WorkloadSnapshot(trajectories=(started.model_copy(update={"fresh": True}),))
    assert predict(fresh, config(colocated=2), profile).breakdown.prompt_backlog_s > 0.0


def test_a_burst_of_fresh_trajectories_favours_the_configuration_with_more_prefill() -> None:
    """1,024 fresh trajectories on 36 instances of 4 GPUs (the shipped 30B scenario's):
    five prefill instances take the prompts far longer than 36 colocated ones, and the
    prediction says so (it did not)."""
    profile = load_profile("qwen3-30b-a3b")
    configs = [config(4, colocated=36), config(4, prefill=5, decode=31)]
    colocated, disaggregated = predict_many(burst(1024), configs, profile)
    assert disaggregated.breakdown.prompt_backlog_s > 5 * colocated.breakdown.prompt_backlog_s
    assert disaggregated.completion_s > colocated.completion_s
    assert colocated.completion_s >= colocated.breakdown.critical_path_s


def test_one_fresh_trajectory_alone_waits_for_its_own_prompt() -> None:
    """Alone, the backlog is its own prompt: the prediction grows by exactly the backlog."""
    profile = load_profile("qwen3-8b")
    queued = TrajectoryProgress(
        traj_id="t0", phase=TrajPhase.QUEUED, context_tokens=8000, remaining_turns=2.0
    )
    cfg = config(colocated=1)
    base = predict(WorkloadSnapshot(trajectories=(queued,)), cfg, profile)
    fresh = queued.model_copy(update={"fresh": True})
    p = predict(WorkloadSnapshot(trajectories=(fresh,)), cfg, profile)
    assert p.breakdown.prompt_backlog_s > 0
    assert p.completion_s == pytest.approx(base.completion_s + p.breakdown.prompt_backlog_s)


def test_a_next_batch_a_moment_from_completion_waits_for_no_prompt() -> None:
    """The one group needed is decoding its last turn; 512 fresh trajectories wait to
    start. Its prefills are done, so the prompts barely delay it (the whole workload
    waits for them)."""
    profile = load_profile("qwen3-8b")
    last = TrajectoryProgress(
        traj_id="t0",
        phase=TrajPhase.DECODE,
        context_tokens=6000,
        remaining_turns=1.0,
        turn_output_tokens=190,
        group_id="g0",
    )
    queued = [
        TrajectoryProgress(
            traj_id=f"q{i}",
            phase=TrajPhase.QUEUED,
            context_tokens=int(profile.workload.prompt_tokens),
            remaining_turns=profile.workload.turns_per_trajectory,
            group_id=f"q{i}",
        )
        for i in range(512)
    ]
    stats = burst(0).stats
    nb = NextBatch(groups_needed=1, group_size=1)
    cfg = config(prefill=1, decode=7)

    def snapshot(fresh: bool, next_batch: NextBatch | None = nb) -> WorkloadSnapshot:
        listed = [q.model_copy(update={"fresh": fresh}) for q in queued]
        return WorkloadSnapshot(trajectories=(last, *listed), stats=stats, next_batch=next_batch)

    fresh, not_fresh = predict(snapshot(True), cfg, profile), predict(snapshot(False), cfg, profile)
    assert fresh.breakdown.prompt_backlog_s > 10 * not_fresh.completion_s
    assert fresh.completion_s < not_fresh.completion_s + 0.1 * fresh.breakdown.prompt_backlog_s
    everyone = predict(snapshot(True, None), cfg, profile)
    assert (
        everyone.completion_s
        >= everyone.breakdown.critical_path_s + everyone.breakdown.prompt_backlog_s
    )
