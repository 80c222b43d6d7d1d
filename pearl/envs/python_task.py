"""``python``: an arithmetic problem solved with the Python sandbox as its tool.

The action convention: a ``<tool_call>{"name": "python", "arguments": {"code": "..."}}
</tool_call>`` block runs its code; a turn with no tool call runs its fenced
```` ```python ```` blocks instead (models often write those). The observation is the
sandbox's rendered output (``pearl.envs.sandbox.render``); ``<answer>N</answer>`` ends the
episode with reward 1.0 when N is right.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from pearl.envs.arithmetic import ArithmeticConfig, problem_maker
from pearl.envs.sandbox import Sandbox, SandboxConfig, render
from pearl.envs.tools import Tool, ToolTask

_FENCED = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


class PythonTaskConfig(ArithmeticConfig):
    sandbox: SandboxConfig = Field(SandboxConfig(), description="Limits of each code run.")


def python_tool(sandbox: Sandbox) -> Tool:
    async def run(arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return "error: arguments need a string 'code'"
        return render(await sandbox.run(code), sandbox.config)

    return Tool(
        name="python",
        description="Run Python code in a sandbox and see what it prints.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "A Python script."}},
            "required": ["code"],
        },
        run=run,
    )


def fenced_blocks(action: str) -> list[tuple[str, str]]:
    return [("python", code) for code in _FENCED.findall(action)]


def python_task(config: PythonTaskConfig) -> ToolTask:
    return ToolTask(
        problem_maker(config, "python"),
        [python_tool(Sandbox(config.sandbox))],
        config.max_turns,
        extra_actions=fenced_blocks,
    )
