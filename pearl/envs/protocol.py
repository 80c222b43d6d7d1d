"""The environment protocol: text in, text out, async (the agent loop is asyncio).

The shape of gymnasium's ``Env`` and ROLL's environments: ``reset(seed) -> (observation,
info)`` gives the first prompt text; ``step(action) -> StepResult`` takes the model's whole
turn (its ``<tool_call>`` blocks included) and returns what the environment says back.
An environment may offer ``tools`` (OpenAI function schemas, for the chat template) and a
``system_prompt``; both are plain attributes, read after ``reset``.

Conventions every shipped environment keeps (``docs/envs.md``):

- ``terminated``: the task ended on its own terms (an answer was given); ``truncated``: it
  was cut short (``info["end_reason"]`` says why: ``max_turns``, ``env_error``, ...).
- ``info["tool_results"]``, when a turn called tools: one ``{"tool_call_id", "name",
  "content"}`` per call, in order, so the agent can append OpenAI ``tool`` messages;
  ``observation`` is their contents joined (or the environment's reply when no tool ran).
- The same ``seed`` gives the same problem; ``reset`` may be called again to start over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns (gymnasium's five values, as one record)."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """The trajectory ends here (terminated or truncated)."""
        return self.terminated or self.truncated


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; ``close`` releases what the environment holds."""

    @property
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI function schemas the environment offers (may be empty)."""
        ...

    @property
    def system_prompt(self) -> str | None:
        """A system message for the conversation, or None."""
        ...

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...
