"""Arithmetic rewards: a right answer 1.0, a wrong one 0.0, truncation at max turns; the
calculator and the single-digit task."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from pearl.envs.arithmetic import (
    ArithmeticConfig,
    SingleDigit,
    SingleDigitConfig,
    arithmetic,
    draw_expression,
    evaluate,
)


def _call(expression: str) -> str:
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        pytest.param("23", 1.0, id="right"),
        pytest.param("24", 0.0, id="wrong"),
        pytest.param("twenty", 0.0, id="not-a-number"),
    ],
)
def test_answer_reward(answer: str, reward: float) -> None:
    async def go() -> None:
        env = arithmetic(ArithmeticConfig())
        prompt, info = await env.reset(seed=0, options={"expression": "3+4*5"})
        assert "3+4*5" in prompt and info["expected"] == 23
        result = await env.step(f"It is <answer>{answer}</answer>")
        assert (result.reward, result.terminated, result.truncated) == (reward, True, False)
        assert result.info["end_reason"] == "answered"

    _run(go())


def test_calculator_turns_then_truncation_at_max_turns() -> None:
    async def go() -> None:
        env = arithmetic(ArithmeticConfig(max_turns=3))
        await env.reset(seed=1, options={"expression": "12*3-4"})
        first = await env.step(_call("12*3"))
        assert first.observation == "36" and not first.done
        (tool_result,) = first.info["tool_results"]
        assert tool_result["name"] == "calculator" and tool_result["content"] == "36"
        second = await env.step("hmm")
        assert "<answer>" in second.observation and not second.done
        third = await env.step(_call("36-4"))
        assert third.observation == "32"
        assert (third.terminated, third.truncated, third.reward) == (False, True, 0.0)
        assert third.info["end_reason"] == "max_turns"

    _run(go())


def test_unknown_tool_and_bad_arguments_are_observations() -> None:
    async def go() -> None:
        env = arithmetic(ArithmeticConfig())
        await env.reset(seed=0)
        body = json.dumps({"name": "search", "arguments": {"q": "x"}})
        unknown = await env.step(f"<tool_call>{body}</tool_call>")
        assert "unknown tool 'search'" in unknown.observation
        body = json.dumps({"name": "calculator", "arguments": {}})
        bad = await env.step(f"<tool_call>{body}</tool_call>")
        assert bad.observation.startswith("error:")

    _run(go())


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3+4", "7"), ("2**10", "1024"), ("7/2", "3.5"), ("(1+2)*-3", "-9"), ("8/4", "2")],
)
def test_calculator_values(expression: str, value: str) -> None:
    from pearl.envs.arithmetic import CALCULATOR

    assert _run(CALCULATOR.run({"expression": expression})) == value


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "1/0", "9**99999", "x+1", "1" * 300, "3+"]
)
def test_calculator_refuses(expression: str) -> None:
    with pytest.raises(ValueError):
        evaluate(expression)


def test_difficulty_knobs() -> None:
    rng = np.random.default_rng(0)
    config = ArithmeticConfig(digits=3, num_operands=4, operators="+")
    for _ in range(20):
        numbers = draw_expression(rng, config).split("+")
        assert len(numbers) == 4 and all(len(n) == 3 for n in numbers)


def test_single_digit_rewards_the_first_digit() -> None:
    async def go() -> None:
        env = SingleDigit(SingleDigitConfig())
        for seed in range(30):
            prompt, info = await env.reset(seed=seed)
            assert prompt.endswith("=") and 0 <= eval(prompt[:-1]) == info["expected"] <= 9
            right = await env.step(f"the sum is {info['expected']}, or 42")
            assert (right.reward, right.terminated) == (1.0, True)
            await env.reset(seed=seed)
            wrong = await env.step(f"{(info['expected'] + 1) % 10}")
            assert (wrong.reward, wrong.terminated) == (0.0, True)
            await env.reset(seed=seed)
            silent = await env.step("no idea")
            assert (silent.reward, silent.truncated) == (0.0, True)
            assert silent.info["end_reason"] == "max_turns"

    _run(go())


def test_single_digit_random_guesses_get_reward_sometimes() -> None:
    """RL has signal from a random policy: a random digit is right about 1 time in 10."""

    async def go() -> float:
        env, rng, total = SingleDigit(SingleDigitConfig()), np.random.default_rng(0), 0.0
        for seed in range(200):
            await env.reset(seed=seed)
            total += (await env.step(str(rng.integers(0, 10)))).reward
        return total / 200

    assert 0.03 < _run(go()) < 0.2
