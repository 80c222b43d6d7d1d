"""Every shipped environment keeps the protocol: reset gives text and info, step gives a
StepResult, close returns; the same seed gives the same problem."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pearl.envs import registry
from pearl.envs.protocol import Environment, StepResult

TRAINABLE = ["arithmetic", "single_digit", "python"]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_every_trainable_env_is_registered() -> None:
    assert set(TRAINABLE) <= set(registry.names())


@pytest.mark.parametrize("name", TRAINABLE)
def test_reset_step_close(name: str) -> None:
    async def go() -> None:
        env = registry.make({"name": name}, "<test>")
        assert isinstance(env, Environment)
        assert isinstance(env.tools, list)
        assert env.system_prompt is None or isinstance(env.system_prompt, str)
        prompt, info = await env.reset(seed=3)
        assert isinstance(prompt, str) and prompt and isinstance(info, dict)
        result = await env.step("I do not know.")
        assert isinstance(result, StepResult)
        assert isinstance(result.observation, str) and isinstance(result.info, dict)
        assert result.reward == 0.0
        await env.close()

    _run(go())


@pytest.mark.parametrize("name", TRAINABLE)
def test_seeds_reproduce_problems(name: str) -> None:
    async def prompts(seeds: range) -> list[str]:
        env = registry.make({"name": name}, "<test>")
        return [(await env.reset(seed=s))[0] for s in seeds]

    first, again = _run(prompts(range(20))), _run(prompts(range(20)))
    assert first == again
    assert len(set(first)) > 1, "different seeds give different problems"


@pytest.mark.parametrize("name", ["arithmetic", "python"])
def test_tool_envs_offer_openai_schemas(name: str) -> None:
    env = registry.make({"name": name}, "<test>")
    (tool,) = env.tools
    assert tool["type"] == "function"
    assert tool["function"]["name"] == {"arithmetic": "calculator", "python": "python"}[name]
    assert tool["function"]["parameters"]["type"] == "object"
