"""Rollouts without engines for the trainer's tests: completions sampled from the
trainer's own torch model (temperature 1, raw logprobs as the engines report them), made
into the ``Trajectory`` and ``RolloutBatch`` the rollout manager hands over. Nothing is
faked: the batches are what ``Spool.write`` writes and the trainer reads."""

from __future__ import annotations

import torch

from pearl.agents.batches import RolloutBatch
from pearl.agents.loop import NOT_GENERATED, Trajectory
from pearl.trainer.model import PolicyModel


@torch.no_grad()
def sample(
    model: PolicyModel, prompts: list[list[int]], group: int, new_tokens: int, gen: torch.Generator
) -> list[tuple[list[int], list[int], list[float]]]:
    """``group`` completions of each prompt (prompt-major): (prompt, output ids, logprobs)."""
    rows = [p for p in prompts for _ in range(group)]
    ids = torch.tensor(rows, dtype=torch.long)  # prompts of one length
    logprobs = []
    for _ in range(new_tokens):
        lp = torch.log_softmax(model.logits(ids)[:, -1], dim=-1)
        nxt = torch.multinomial(lp.exp(), 1, generator=gen)
        logprobs.append(lp.gather(-1, nxt))
        ids = torch.cat([ids, nxt], dim=1)
    out = ids[:, len(rows[0]) :].tolist()
    lps = torch.cat(logprobs, dim=1).tolist()
    return [(rows[i], out[i], lps[i]) for i in range(len(rows))]


def trajectory(
    traj_id: str,
    prompt: list[int],
    output: list[int],
    logprobs: list[float],
    version: int,
    reward: float,
    end_reason: str = "answered",
) -> Trajectory:
    t = Trajectory(traj_id, reward=reward, end_reason=end_reason)
    t.append(prompt, generated=False)
    t.append(output, generated=True, logprobs=logprobs, versions=[version] * len(output))
    return t


def batch_of(
    batch_id: int, policy_version: int, trajs: list[Trajectory], group: int
) -> RolloutBatch:
    off = sum(1 for t in trajs for v in t.versions if v != NOT_GENERATED and v < policy_version)
    stale = [policy_version - min(v for v in t.versions if v >= 0) for t in trajs]
    return RolloutBatch(
        batch_id=batch_id,
        policy_version=policy_version,
        trajectories=tuple(trajs),
        group_ids=tuple(i // group for i in range(len(trajs))),
        off_policy_tokens=off,
        max_staleness_versions=max(stale, default=0),
        mean_staleness_versions=sum(stale) / len(stale) if stale else 0.0,
    )


def subset_reward(output: list[int], subset: frozenset[int]) -> float:
    """The fraction of the output's tokens in ``subset``."""
    return sum(t in subset for t in output) / len(output)


def make_batch(
    model: PolicyModel,
    batch_id: int,
    version: int,
    *,
    prompts: list[list[int]],
    group: int,
    new_tokens: int,
    subset: frozenset[int],
    gen: torch.Generator,
) -> RolloutBatch:
    """A batch sampled from ``model`` (whose weights are ``version``), rewarded by
    ``subset_reward``."""
    trajs = [
        trajectory(f"b{batch_id}-t{i}", p, o, lp, version, subset_reward(o, subset))
        for i, (p, o, lp) in enumerate(sample(model, prompts, group, new_tokens, gen))
    ]
    return batch_of(batch_id, version, trajs, group)
