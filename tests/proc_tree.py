"""Processes as the tests see them, from ``/proc`` (Linux): children of a process, and
whether one has gone."""

from __future__ import annotations

import time
from pathlib import Path


def children(pid: int, marker: bytes) -> list[int]:
    """Processes whose parent is ``pid`` and that have ``marker`` as one of their arguments.

    A whole argument, not a substring of the command line: a child forked but not yet
    exec'd still shows its parent's command line, whose arguments may quote the command
    it is about to run (an agent's ``--engine "*=python -m pearl.engines.fake ..."``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and marker in cmd.split(b"\0"):
            out.append(int(d.name))
    return out


def gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` exits within ``timeout_s`` (a zombie counts as gone)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; its new parent has not reaped it yet
            return True
        time.sleep(0.05)
    return False


def describe(pid: int) -> str:
    """``PID STATE PPID: CMDLINE`` of a process, for a failure message."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"{pid} gone"
    return f"{pid} {fields[0]} {fields[1]}: {cmd}"
