"""Environments that misbehave on purpose, for tests of ``safe_step`` and the agent loop
(registered as ``crashing``, ``hanging`` and ``chatty``; never for training).

- ``crashing``: raises ``RuntimeError`` at step ``crash_at_step`` (1-based);
- ``hanging``: its step ``hang_at_step`` never returns;
- ``chatty``: every observation is ``observation_chars`` characters long.

Before that step each answers ``ok`` with reward 0.0; none ever ends on its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from pearl.core.state import Frozen
from pearl.envs.protocol import StepResult


class BrokenConfig(Frozen):
    crash_at_step: int = Field(1, ge=1, description="crashing: the step that raises.")
    hang_at_step: int = Field(1, ge=1, description="hanging: the step that never returns.")
    observation_chars: int = Field(
        100_000, ge=1, le=100_000_000, description="chatty: characters of each observation."
    )


class Broken:
    system_prompt: str | None = None

    def __init__(self, kind: str, config: BrokenConfig) -> None:
        self.kind, self.config, self._steps = kind, config, 0
        self.tools: list[dict[str, Any]] = []

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self._steps = 0
        return f"A {self.kind} environment.", {}

    async def step(self, action: str) -> StepResult:
        self._steps += 1
        if self.kind == "crashing" and self._steps >= self.config.crash_at_step:
            raise RuntimeError(f"crashing env: step {self._steps}")
        if self.kind == "hanging" and self._steps >= self.config.hang_at_step:
            await asyncio.Event().wait()  # forever
        if self.kind == "chatty":
            return StepResult("x" * self.config.observation_chars, 0.0, False, False, {})
        return StepResult("ok", 0.0, False, False, {})

    async def close(self) -> None:
        pass
