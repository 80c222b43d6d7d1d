"""The rollout manager the manager tests run: two colocated reference engines, the
arithmetic environment, groups of 2, batches of 4, staleness bound 1, at most 8 running."""

from __future__ import annotations

from pathlib import Path

from pearl.agents.loop import Limits
from pearl.agents.manager import RolloutConfig, RolloutManager
from pearl.core.roles import Role
from pearl.engines.reference.tokenizer import load
from pearl.envs import registry
from pearl.rollout.rules import PastBound, RolloutRules
from pearl.router.router import Router, Sampling

RULES = RolloutRules(
    batch_trajectories=4,
    max_staleness_versions=1,
    group_size=2,
    max_in_flight=8,
    past_bound=PastBound.RESTART,
)
CONFIG = RolloutConfig(
    rules=RULES,
    sampling=Sampling(max_tokens=12, temperature=1.0, seed=7),
    limits=Limits(max_turns=3, max_context_tokens=1024, step_timeout_s=10),
    seed=3,
    snapshot_interval_s=0.2,
)
ENV = {"name": "arithmetic", "max_turns": 3}


async def open_manager(
    model_dir: Path,
    run_dir: Path,
    urls: list[str],
    config: RolloutConfig = CONFIG,
    roles: list[Role] | None = None,
) -> RolloutManager:
    """The manager on ``run_dir`` over engines ``e0, e1, ...`` at ``urls`` (colocated, or
    in ``roles``)."""
    router = Router()
    for i, url in enumerate(urls):
        router.table.serve(f"e{i}", url, roles[i] if roles else Role.COLOCATED)
    return await RolloutManager.open(
        router, lambda: registry.make(ENV, "test.yaml"), load(model_dir), config, run_dir
    )
