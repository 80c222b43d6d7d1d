"""The Python sandbox's limits are enforced, and each failure is an observation."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pearl.envs.python_task import PythonTaskConfig, python_task
from pearl.envs.sandbox import Sandbox, SandboxConfig, SandboxError, SandboxResult, render

FAST = SandboxConfig(timeout_s=1.0, cpu_time_s=5, memory_mb=256)


def _run(code: str, config: SandboxConfig = FAST) -> tuple[SandboxResult, str]:
    result = asyncio.run(Sandbox(config).run(code))
    return result, render(result, config)


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def _namespace_permitted() -> bool:
    try:
        _run("pass", SandboxConfig(network="namespace"))
    except SandboxError:
        return False
    return True


def test_output_is_the_observation() -> None:
    result, text = _run("print(6 * 7)")
    assert (result.exit_code, result.timed_out, text) == (0, False, "42")
    assert _run("pass")[1] == "(no output)"


def test_wall_clock_timeout_kills_the_process_group() -> None:
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
    start = time.monotonic()
    result, text = _run(code + "while True: pass")
    assert time.monotonic() - start < FAST.timeout_s + 1.0
    assert result.timed_out and "[timed out after 1 s; killed]" in text


def test_cpu_time_limit() -> None:
    config = SandboxConfig(timeout_s=10.0, cpu_time_s=1, memory_mb=256)
    start = time.monotonic()
    result, text = _run("while True: pass", config)
    assert time.monotonic() - start < 3.5 and not result.timed_out
    assert result.signal_name in ("SIGXCPU", "SIGKILL")
    assert "CPU time limit of 1 s" in text


def test_memory_limit_is_a_memory_error() -> None:
    result, text = _run("x = bytearray(2**31)")
    assert result.exit_code == 1 and "MemoryError" in text and "[exit status 1]" in text


def test_file_size_limit() -> None:
    config = FAST.model_copy(update={"max_file_mb": 1})
    result, text = _run("open('big', 'wb').write(b'x' * 2**21)", config)
    assert result.exit_code == 1 and "File too large" in text


def test_a_crash_is_an_observation() -> None:
    result, text = _run("def f():\n    return 1 / 0\nf()")
    assert result.exit_code == 1
    assert 'File "main.py", line 2, in f' in text and "ZeroDivisionError" in text
    assert "sandbox_child" not in text  # the launcher's frame is left out


@pytest.mark.parametrize("network", ["auto", "audit_hook"])
def test_no_network(network: str, listening_port: int) -> None:
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listening_port}), timeout=2)\n"
    code += "print('connected')"
    result, text = _run(code, FAST.model_copy(update={"network": network}))
    assert "connected" not in result.stdout and result.exit_code == 1, text
    if network == "audit_hook":
        assert result.network == "audit_hook" and "PermissionError" in text
    else:
        assert result.network in ("namespace", "audit_hook")


def test_namespace_when_permitted(listening_port: int) -> None:
    if not _namespace_permitted():
        pytest.skip("unshare(CLONE_NEWNET) is not permitted here")
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listening_port}), timeout=2)"
    result, text = _run(code, FAST.model_copy(update={"network": "namespace"}))
    assert result.network == "namespace" and "Network is unreachable" in text


def test_fresh_working_directory_removed_afterwards() -> None:
    code = "import os, json\nopen('scratch.txt', 'w').write('x')\n"
    code += "print(json.dumps([os.getcwd(), sorted(os.listdir('.'))]))"
    result, _ = _run(code)
    cwd, listing = json.loads(result.stdout)
    assert listing == ["main.py", "scratch.txt"]
    assert not Path(cwd).exists() and not Path(cwd).parent.exists()


def test_output_truncated_to_the_limit() -> None:
    config = FAST.model_copy(update={"max_output_chars": 100})
    result, text = _run("print('x' * 100_000)", config)
    assert result.output_truncated and len(text) <= 100
    assert text.endswith("[output truncated to 100 characters]")


def test_python_task_runs_tool_calls_and_fenced_blocks() -> None:
    async def go() -> list[Any]:
        env = python_task(PythonTaskConfig(sandbox=FAST))
        await env.reset(seed=0, options={"expression": "17*23"})
        call = {"name": "python", "arguments": {"code": "print(17*23)"}}
        by_call = await env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
        by_block = await env.step("Let me run:\n```python\nprint(17*23 + 1)\n```")
        answer = await env.step("<answer>391</answer>")
        return [by_call.observation, by_block.observation, answer.reward]

    assert asyncio.run(go()) == ["391", "392", 1.0]
