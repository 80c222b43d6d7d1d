"""Helpers for the control-plane tests: start the coordinator harness and agents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pearl.control.agent import agent_command
from pearl.control.mpi import find_mpiexec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def mpiexec_or_skip() -> str:
    found = find_mpiexec()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        found = None
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("mpiexec/mpi4py unavailable but CI is set")
        print("control-plane tests skipped: mpiexec or mpi4py not available")
        pytest.skip("mpiexec or mpi4py not available")
    return found


class Coordinator:
    def __init__(self, run_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [
                mpiexec_or_skip(),
                "-n",
                "1",
                sys.executable,
                str(HERE / "control_harness.py"),
                str(run_dir),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self.read() == {"ready": True}

    def read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "coordinator harness exited"
        return json.loads(line)

    def call(self, op: str, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=10)
            except (AssertionError, BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def start_agent(
    run_dir: Path, agent_id: str, node: str, *extra: str, stderr: Any = None
) -> subprocess.Popen[str]:
    mpiexec_or_skip()
    argv = agent_command(run_dir, node, "--agent-id", agent_id, *extra)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=stderr, text=True, cwd=REPO)


def fake_engine_args() -> list[str]:
    return ["--engine", f"*={sys.executable} -m pearl.engines.fake --port {{port}}"]


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
