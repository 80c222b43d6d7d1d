"""The latency wrapper, safe_step/safe_reset and the registry's one-line errors."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pearl.envs import registry
from pearl.envs.arithmetic import ArithmeticConfig, arithmetic
from pearl.envs.latency import WithToolLatency, latency_samples
from pearl.envs.robust import safe_reset, safe_step
from pearl.io.documents import InputError


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_shipped_latencies_are_read() -> None:
    samples = latency_samples("shipped")
    assert samples.ndim == 1 and len(samples) > 10 and (samples > 0).all()


def test_latency_wrapper_sleeps_seeded_scaled_draws() -> None:
    samples_s = np.array([1.0, 2.0, 3.0])

    async def latencies(seed: int) -> tuple[list[float], float]:
        rng = np.random.default_rng(seed)
        env = WithToolLatency(arithmetic(ArithmeticConfig(max_turns=10)), samples_s, rng, 0.02)
        assert env.tools and env.system_prompt is None
        await env.reset(seed=0)
        start = time.monotonic()
        slept = [(await env.step("hmm")).info["tool_latency_s"] for _ in range(5)]
        return slept, time.monotonic() - start

    slept, elapsed = _run(latencies(7))
    assert slept == _run(latencies(7))[0]
    assert all(s in (0.02, 0.04, 0.06) for s in (round(x, 6) for x in slept))
    assert elapsed >= sum(slept) - 1e-3


def test_latency_wrapper_from_a_config() -> None:
    section = {"name": "arithmetic", "tool_latency": {"source": "shipped", "scale": 0.0}}
    env = registry.make(section, "<test>")
    assert isinstance(env, WithToolLatency)

    async def go() -> float:
        await env.reset(seed=0)
        return float((await env.step("x")).info["tool_latency_s"])

    assert _run(go()) == 0.0


@pytest.mark.parametrize(
    ("section", "end_reason", "error"),
    [
        pytest.param(
            {"name": "crashing", "crash_at_step": 2}, "env_error", "RuntimeError", id="crash"
        ),
        pytest.param({"name": "hanging", "hang_at_step": 2}, "env_timeout", "0.2 s", id="hang"),
        pytest.param(
            {"name": "chatty", "observation_chars": 5000},
            "observation_too_long",
            "5000",
            id="too-long",
        ),
    ],
)
def test_safe_step_records_why(section: dict[str, Any], end_reason: str, error: str) -> None:
    async def go() -> list[Any]:
        env = registry.make(section, "<test>")
        started = await safe_reset(env, seed=0, timeout_s=1.0)
        first = await safe_step(env, "a", timeout_s=0.2, max_observation_chars=1000)
        second = await safe_step(env, "b", timeout_s=0.2, max_observation_chars=1000)
        await env.close()
        return [started, first, second]

    started, first, second = _run(go())
    assert not started.done and started.observation
    last = first if end_reason == "observation_too_long" else second
    if last is second:
        assert not first.done and first.observation == "ok"
    assert (last.truncated, last.terminated, last.reward) == (True, False, 0.0)
    assert last.info["end_reason"] == end_reason and error in last.info["error"]


def test_safe_step_token_limit() -> None:
    async def go() -> Any:
        env = registry.make({"name": "chatty", "observation_chars": 50}, "<test>")
        await env.reset()
        return await safe_step(
            env, "a", 1.0, max_observation_tokens=10, count_tokens=lambda t: len(t.split("x"))
        )

    result = _run(go())
    assert result.info["end_reason"] == "observation_too_long" and "tokens" in result.info["error"]


def test_safe_reset_of_a_failing_reset() -> None:
    class Failing:
        tools: list[dict[str, Any]] = []  # noqa: RUF012
        system_prompt = None

        async def reset(self, seed: int | None = None, options: Any = None) -> Any:
            raise OSError("disk gone")

    result = _run(safe_reset(Failing(), timeout_s=1.0))  # type: ignore[arg-type]
    assert result.truncated and result.info["end_reason"] == "env_error"
    assert "OSError: disk gone" in result.info["error"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        pytest.param([], "cfg.yaml: env: expected a mapping", id="not-a-mapping"),
        pytest.param({}, "cfg.yaml: env.name: missing", id="no-name"),
        pytest.param(
            {"name": "chess"}, "cfg.yaml: env.name: unknown environment 'chess'", id="unknown"
        ),
        pytest.param({"name": "arithmetic", "digits": 0}, "cfg.yaml: env.digits: ", id="bad-field"),
        pytest.param(
            {"name": "arithmetic", "colour": 1}, "cfg.yaml: env.colour: ", id="unknown-field"
        ),
        pytest.param(
            {"name": "arithmetic", "operators": "/"},
            "cfg.yaml: env.operators: ",
            id="bad-operators",
        ),
        pytest.param(
            {"name": "python", "sandbox": {"timeout_s": -1}},
            "cfg.yaml: env.sandbox.timeout_s: ",
            id="nested",
        ),
        pytest.param(
            {"name": "arithmetic", "tool_latency": {"scale": -1}},
            "cfg.yaml: env.tool_latency.scale: ",
            id="latency",
        ),
    ],
)
def test_registry_errors_are_one_line_naming_the_field(section: Any, message: str) -> None:
    with pytest.raises(InputError) as caught:
        registry.make(section, "cfg.yaml")
    text = str(caught.value)
    assert text.startswith(message) and "\n" not in text


def test_latency_source_relative_to_the_config(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        registry.make(
            {"name": "arithmetic", "tool_latency": {"source": "nope.json"}}, tmp_path / "cfg.yaml"
        )
    assert str(caught.value) == f"{tmp_path / 'nope.json'}: (document): no such file"


def test_a_name_registers_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        registry.register("arithmetic", arithmetic, ArithmeticConfig)
