"""The agent loop over real reference engines and real environments: multi-turn episodes
keep one token stream whose every prompt extends the last, a loss mask over exactly the
generated tokens, their logprobs and versions; a crashing environment ends its own
trajectory with the reason recorded while the others finish."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from engine_procs import EngineProc, running_engines

from pearl.agents.loop import NOT_GENERATED, Limits, Trajectory, run_episode
from pearl.core.roles import Role
from pearl.engines.reference.tokenizer import load
from pearl.envs import registry
from pearl.router.router import Router, Sampling


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProc]]:
    with running_engines(
        tiny_model_dir, tmp_path_factory.mktemp("agent-engines"), ("a0", "a1")
    ) as procs:
        yield procs


def _episodes(
    engines: list[EngineProc], model: Path, envs: list[dict[str, object]]
) -> list[Trajectory]:
    tok = load(model)
    sampling = Sampling(max_tokens=24, temperature=1.0, seed=None)
    limits = Limits(max_turns=3, max_context_tokens=2048, step_timeout_s=10)

    async def run() -> list[Trajectory]:
        r = Router()
        for e in engines:
            r.table.serve(e.name, e.url, Role.COLOCATED)
        try:
            return await asyncio.gather(
                *(
                    run_episode(
                        r, registry.make(cfg, "test.yaml"), tok, f"ep{i}", sampling, limits, seed=i
                    )
                    for i, cfg in enumerate(envs)
                )
            )
        finally:
            await r.aclose()

    return asyncio.run(run())


def test_episodes_keep_one_token_stream_and_a_loss_mask(
    engines: list[EngineProc], tiny_model_dir: Path
) -> None:
    arithmetic = {"name": "arithmetic", "max_turns": 3}
    trajs = _episodes(engines, tiny_model_dir, [arithmetic] * 4)
    for t in trajs:
        assert t.end_reason in ("answered", "max_turns"), t.end_reason
        assert 1 <= len(t.turns) <= 3
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert t.generated_tokens == sum(turn.output_tokens for turn in t.turns)
        for turn in t.turns:  # every prompt is a prefix of the stream, the model's tokens next
            start = turn.prompt_tokens
            assert t.loss_mask[start - 1] == 0 and all(
                t.loss_mask[start : start + turn.output_tokens]
            )
        gen = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        assert gen and all(v == 0 for v in gen)  # the served weights' version
        assert all(
            v == NOT_GENERATED for v, m in zip(t.versions, t.loss_mask, strict=True) if not m
        )
        assert all(lp <= 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
        assert t.reward in (0.0, 1.0)


def test_a_crashing_environment_ends_only_its_own_trajectory(
    engines: list[EngineProc], tiny_model_dir: Path
) -> None:
    crashing = {"name": "crashing", "crash_at_step": 1}
    arithmetic = {"name": "arithmetic", "max_turns": 2}
    bad, good = _episodes(engines, tiny_model_dir, [crashing, arithmetic])
    assert bad.end_reason == "env_error" and "crashing env" in bad.info["error"]
    assert len(bad.turns) == 1 and bad.reward == 0.0
    assert good.end_reason in ("answered", "max_turns") and good.turns
