"""``WithToolLatency``: an environment whose steps take as long as real tools do.

Each ``step`` first sleeps ``scale`` times a latency drawn (with replacement, from the
seeded generator) from observed tool latencies, by default the shipped
``pearl/data/agentic_workload.json`` (``tool_latency_s``); ``info["tool_latency_s"]`` says
how long it slept. ``reset`` and ``close`` pass through without delay.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from pearl.core.state import Frozen
from pearl.envs.protocol import Environment, StepResult
from pearl.io.data_files import SHIPPED_WORKLOAD, read_workload_samples, shipped

LATENCY_KEY = "tool_latency_s"  # read_workload_samples' key of the tool latencies


class ToolLatencyConfig(Frozen):
    source: str = Field(
        "shipped", description="'shipped', or the path of a pearl.workload_samples file."
    )
    scale: float = Field(1.0, ge=0.0, le=100.0, description="Factor on every latency.")
    seed: int = Field(0, ge=0, description="Seed of the latency draws.")


def latency_samples(source: str, relative_to: Path | None = None) -> NDArray[np.float64]:
    """The tool latencies (seconds) of ``source``: ``shipped`` or a workload-samples file."""
    if source == "shipped":
        path = shipped(SHIPPED_WORKLOAD)
    else:
        path = Path(source)
        if relative_to is not None and not path.is_absolute():
            path = relative_to / path
    return read_workload_samples(path)[LATENCY_KEY]


class WithToolLatency:
    def __init__(
        self,
        env: Environment,
        samples_s: NDArray[np.float64],
        rng: np.random.Generator,
        scale: float = 1.0,
    ) -> None:
        if len(samples_s) == 0:
            raise ValueError("no latency samples")
        self.env, self.samples_s, self.rng, self.scale = env, samples_s, rng, scale

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.env.tools

    @property
    def system_prompt(self) -> str | None:
        return self.env.system_prompt

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        return await self.env.reset(seed, options)

    async def step(self, action: str) -> StepResult:
        latency_s = self.scale * float(self.rng.choice(self.samples_s))
        await asyncio.sleep(latency_s)
        result = await self.env.step(action)
        return StepResult(
            result.observation,
            result.reward,
            result.terminated,
            result.truncated,
            result.info | {"tool_latency_s": latency_s},
        )

    async def close(self) -> None:
        await self.env.close()
