"""Tools an environment offers, and one multi-turn task env that runs them.

A ``Tool`` is an OpenAI function schema and an async ``run(arguments) -> text``.
``ToolTask`` is the loop every shipped task shares: each turn either answers
(``<answer>N</answer>``: terminated, reward 1.0 when N is the expected integer, else 0.0)
or calls tools (Hermes ``<tool_call>`` blocks, parsed by
``pearl.engines.reference.tool_calls``), whose results are the observation; ``max_turns``
turns without an answer end it truncated (``info["end_reason"] == "max_turns"``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pearl.engines.reference.tool_calls import parse_tool_calls
from pearl.envs.protocol import StepResult

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUDGE = "No tool call and no answer. Reply <answer>N</answer> when done."


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    run: Callable[[dict[str, Any]], Awaitable[str]]

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class Problem:
    text: str  # the prompt shown to the model
    answer: int


def given_answer(action: str) -> str | None:
    """The text of the last ``<answer>...</answer>`` in the turn, stripped; None if none."""
    found = ANSWER.findall(action)
    return found[-1].strip() if found else None


def as_int(text: str) -> int | None:
    try:
        return int(text.replace(",", "").strip())
    except ValueError:
        return None


class ToolTask:
    """An integer-answer task with tools; ``problems(rng, options)`` draws one problem."""

    def __init__(
        self,
        problems: Callable[[np.random.Generator, dict[str, Any]], Problem],
        tools: list[Tool],
        max_turns: int,
        system_prompt: str | None = None,
        extra_actions: Callable[[str], list[tuple[str, str]]] | None = None,
    ) -> None:
        self._problems, self._tools = problems, {t.name: t for t in tools}
        self.max_turns, self.system_prompt = max_turns, system_prompt
        self.tools = [t.schema for t in tools]
        self._extra_actions = extra_actions  # (tool name, code) pairs found another way
        self._problem: Problem | None = None
        self._turns = 0

    @property
    def problem(self) -> Problem:
        if self._problem is None:
            raise RuntimeError("step before reset")
        return self._problem

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self._problem = self._problems(np.random.default_rng(seed), options or {})
        self._turns = 0
        return self._problem.text, {"expected": self._problem.answer, "seed": seed}

    async def step(self, action: str) -> StepResult:
        problem = self.problem
        self._turns += 1
        info: dict[str, Any] = {"turn": self._turns}
        answer = given_answer(action)
        if answer is not None:
            correct = as_int(answer) == problem.answer
            info |= {"answer": answer, "expected": problem.answer, "correct": correct}
            info["end_reason"] = "answered"
            return StepResult(
                "Correct." if correct else "Wrong.", float(correct), True, False, info
            )
        results = await self._run_tools(action)
        if results:
            info["tool_results"] = results
        observation = "\n".join(r["content"] for r in results) if results else NUDGE
        truncated = self._turns >= self.max_turns
        if truncated:
            info["end_reason"] = "max_turns"
        return StepResult(observation, 0.0, False, truncated, info)

    async def close(self) -> None:
        self._problem = None

    async def _run_tools(self, action: str) -> list[dict[str, Any]]:
        _, calls = parse_tool_calls(action)
        results = []
        for call in calls:
            name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
            content = await self._call(name, arguments)
            results.append({"tool_call_id": call["id"], "name": name, "content": content})
        if not calls and self._extra_actions is not None:
            for i, (name, code) in enumerate(self._extra_actions(action)):
                content = await self._call(name, {"code": code})
                results.append({"tool_call_id": f"block_{i}", "name": name, "content": content})
        return results

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        tool = self._tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r} (tools: {', '.join(self._tools)})"
        return await tool.run(arguments)
