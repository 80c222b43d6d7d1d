"""``safe_step`` and ``safe_reset``: an environment's failure ends its trajectory, never
the rollout.

An exception, a hang past ``timeout_s`` or an observation over the character (or token)
limit becomes a terminal ``StepResult``: ``truncated=True``, reward 0.0, and
``info["end_reason"]`` one of ``END_REASONS`` with ``info["error"]`` saying what happened,
so the agent loop records why and goes on with the other trajectories. Cancellation of the
caller still propagates (it is not the environment's failure).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pearl.envs.protocol import Environment, StepResult

ENV_ERROR, ENV_TIMEOUT, OBSERVATION_TOO_LONG = "env_error", "env_timeout", "observation_too_long"
END_REASONS = (ENV_ERROR, ENV_TIMEOUT, OBSERVATION_TOO_LONG)
MAX_ERROR_CHARS = 500


def failed(end_reason: str, error: str, info: dict[str, Any] | None = None) -> StepResult:
    """The terminal result of a failed environment call."""
    extra = {"end_reason": end_reason, "error": error[:MAX_ERROR_CHARS]}
    return StepResult("", 0.0, False, True, (info or {}) | extra)


async def safe_step(
    env: Environment,
    action: str,
    timeout_s: float,
    max_observation_chars: int | None = None,
    max_observation_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> StepResult:
    """``env.step(action)``, or a terminal result saying why it failed. The token limit
    needs ``count_tokens`` (the tokenizer's ``len(encode(text))``)."""
    result, failure = await _guarded(env.step(action), timeout_s, "step")
    if failure is not None:
        return failure
    problem = _too_long(
        result.observation, max_observation_chars, max_observation_tokens, count_tokens
    )
    if problem is not None:
        return failed(OBSERVATION_TOO_LONG, problem, result.info)
    return result  # type: ignore[no-any-return]


async def safe_reset(
    env: Environment,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    max_observation_chars: int | None = None,
) -> StepResult:
    """``env.reset(seed, options)`` as a ``StepResult`` (the prompt as ``observation``,
    not done), or a terminal one saying why it failed."""
    outcome, failure = await _guarded(env.reset(seed, options), timeout_s, "reset")
    if failure is not None:
        return failure
    observation, info = outcome
    problem = _too_long(observation, max_observation_chars, None, None)
    if problem is not None:
        return failed(OBSERVATION_TOO_LONG, problem, info)
    return StepResult(observation, 0.0, False, False, info)


async def _guarded(
    call: Awaitable[Any], timeout_s: float, what: str
) -> tuple[Any, StepResult | None]:
    """``(value, None)``, or ``(None, failure)`` when the call raised or timed out."""
    try:
        return await asyncio.wait_for(call, timeout_s), None
    except TimeoutError:
        return None, failed(ENV_TIMEOUT, f"{what} took longer than {timeout_s:g} s")
    except asyncio.CancelledError:
        raise
    except Exception as err:
        return None, failed(ENV_ERROR, f"{what} raised {type(err).__name__}: {err}")


def _too_long(
    text: str,
    max_chars: int | None,
    max_tokens: int | None,
    count_tokens: Callable[[str], int] | None,
) -> str | None:
    if max_chars is not None and len(text) > max_chars:
        return f"observation of {len(text)} characters, over the limit of {max_chars}"
    if max_tokens is not None:
        if count_tokens is None:
            raise ValueError("max_observation_tokens needs count_tokens")
        n = count_tokens(text)
        if n > max_tokens:
            return f"observation of {n} tokens, over the limit of {max_tokens}"
    return None
