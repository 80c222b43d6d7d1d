"""A Python tool sandbox: the model's code runs in a fresh subprocess under limits.

Each ``Sandbox.run(code)`` writes ``code`` to ``main.py`` in a new temporary directory,
starts ``sys.executable -I [-S] sandbox_child.py`` there in its own session (process
group), and returns a ``SandboxResult``; ``render`` turns it into the observation text.
A timeout, a memory blow-up or a crash is a result, never an exception to the caller; only
a sandbox that cannot be set up as configured raises ``SandboxError``.

What is enforced, and how (``docs/envs.md``, "The Python sandbox"):

- wall clock: ``timeout_s``, then SIGKILL to the whole process group;
- CPU time: ``RLIMIT_CPU`` (soft ``cpu_time_s``: SIGXCPU; hard one second later: SIGKILL);
- memory: ``RLIMIT_AS`` of ``memory_mb`` (allocations fail with ``MemoryError``);
- files: ``RLIMIT_FSIZE`` of ``max_file_mb`` per file (a write past it fails with
  ``OSError: File too large``), no core dumps, in a temporary
  working directory removed afterwards (``HOME`` and ``TMPDIR`` point there);
- network: a new network namespace (``unshare(CLONE_NEWNET)``, needs root or
  ``CAP_SYS_ADMIN``) with only a down loopback; where that is refused, PEP 578 audit hooks
  refuse sockets, subprocesses, forks and ctypes (best effort: a determined C extension
  gets past them). ``network: namespace`` makes the namespace mandatory;
- output: stdout and stderr each kept to ``max_output_chars`` (the rest is read and
  dropped), the observation cut to the same limit;
- interpreter: ``-I`` (no ``PYTHON*`` variables, no user site, no script directory on the
  path), ``-S`` (no site-packages) unless ``site_packages: true``; stdin is empty.

Not enforced: the filesystem outside the working directory is readable (and writable as
far as the user's permissions go: no chroot, no mount namespace); the number of processes
(``RLIMIT_NPROC`` does not bind root); a child that starts its own session escapes the
group kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from pearl.core.state import Frozen

CHILD = Path(__file__).with_name("sandbox_child.py")
SETUP_FAILED = 125  # sandbox_child's status when the network cannot be cut as asked
DRAIN_AFTER_KILL_S = 1.0  # how long to wait for the pipes once the process group is dead
_CHUNK = 65536


class SandboxConfig(Frozen):
    timeout_s: float = Field(5.0, gt=0, le=600, description="Wall-clock limit of one run.")
    cpu_time_s: int = Field(5, ge=1, le=600, description="CPU-time limit (RLIMIT_CPU).")
    memory_mb: int = Field(
        512, ge=64, le=65536, description="Address-space limit (RLIMIT_AS), MiB."
    )
    max_file_mb: int = Field(16, ge=1, le=4096, description="Largest file it may write, MiB.")
    max_output_chars: int = Field(
        2000, ge=100, le=1_000_000, description="Characters of output kept for the model."
    )
    network: Literal["auto", "namespace", "audit_hook"] = Field(
        "auto",
        description="How the network is cut: a network namespace when permitted, else audit "
        "hooks (auto); the namespace or fail (namespace); audit hooks only (audit_hook).",
    )
    site_packages: bool = Field(
        False, description="Let the code import installed packages (drops python -S)."
    )


class SandboxError(RuntimeError):
    """The sandbox could not be set up as configured (not the code's fault)."""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # None when killed by the timeout
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    duration_s: float
    network: str  # how the network was cut: namespace | audit_hook

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code >= 0:
            return None
        return signal.Signals(-self.exit_code).name


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()

    async def run(self, code: str) -> SandboxResult:
        root = Path(tempfile.mkdtemp(prefix="pearl-sandbox-"))
        try:
            work = root / "work"
            work.mkdir()
            (work / "main.py").write_text(code, encoding="utf-8")
            return await self._run_in(work, root / "status.json")
        finally:
            shutil.rmtree(root, ignore_errors=True)

    async def _run_in(self, work: Path, status: Path) -> SandboxResult:
        c = self.config
        limits = {
            "network": c.network,
            "memory_bytes": c.memory_mb * 2**20,
            "cpu_time_s": c.cpu_time_s,
            "file_bytes": c.max_file_mb * 2**20,
        }
        flags = ["-I"] if c.site_packages else ["-I", "-S"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        env |= {"HOME": str(work), "TMPDIR": str(work)}
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *flags,
            str(CHILD),
            json.dumps(limits),
            str(status),
            cwd=work,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        out, err = bytearray(), bytearray()
        assert proc.stdout is not None and proc.stderr is not None
        limit = c.max_output_chars * 4  # bytes: a character is at most 4 of them in UTF-8
        drains = asyncio.gather(_drain(proc.stdout, out, limit), _drain(proc.stderr, err, limit))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), c.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:  # also when the caller is cancelled: nothing of the run outlives it
            _kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
        duration_s = time.monotonic() - start
        try:
            over = tuple(await asyncio.wait_for(drains, DRAIN_AFTER_KILL_S))
        except TimeoutError:  # something escaped the group and holds the pipes
            over = (True, True)
        network = _network(status, proc.returncode)
        return SandboxResult(
            exit_code=None if timed_out else proc.returncode,
            stdout=_text(out, c.max_output_chars),
            stderr=_text(err, c.max_output_chars),
            timed_out=timed_out,
            output_truncated=any(over) or len(out) > limit or len(err) > limit,
            duration_s=duration_s,
            network=network,
        )


def render(result: SandboxResult, config: SandboxConfig) -> str:
    """The observation: stdout, then ``[stderr]`` and stderr when there is any, then one
    bracketed line per abnormal end (timeout, signal, exit status, truncation); ``(no
    output)`` when nothing was printed. Cut to ``max_output_chars``."""
    parts = [result.stdout] if result.stdout else []
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr}")
    notes = []
    if result.timed_out:
        notes.append(f"[timed out after {config.timeout_s:g} s; killed]")
    elif result.signal_name == "SIGXCPU" or (
        result.signal_name == "SIGKILL" and result.duration_s >= config.cpu_time_s
    ):
        notes.append(f"[killed: CPU time limit of {config.cpu_time_s} s]")
    elif result.signal_name == "SIGXFSZ":  # C code; Python itself ignores SIGXFSZ
        notes.append(f"[killed: file size limit of {config.max_file_mb} MiB]")
    elif result.signal_name is not None:
        notes.append(f"[killed by {result.signal_name}]")
    elif result.exit_code:
        notes.append(f"[exit status {result.exit_code}]")
    if result.output_truncated:
        notes.append(f"[output truncated to {config.max_output_chars} characters]")
    body = "\n".join(p.rstrip("\n") for p in parts) or "(no output)"
    room = config.max_output_chars - sum(len(n) + 1 for n in notes)
    if len(body) > room:
        body = body[: max(room, 0)]
        if not result.output_truncated:
            notes.append(f"[output truncated to {config.max_output_chars} characters]")
    return "\n".join([body, *notes])


async def _drain(stream: asyncio.StreamReader, kept: bytearray, limit: int) -> bool:
    """Read ``stream`` to its end, keeping the first ``limit`` bytes; whether any were
    dropped."""
    dropped = False
    while chunk := await stream.read(_CHUNK):
        room = limit - len(kept)
        kept += chunk[: max(room, 0)]
        dropped = dropped or len(chunk) > room
    return dropped


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def _network(status: Path, exit_code: int | None) -> str:
    try:
        state: dict[str, Any] = json.loads(status.read_text())
    except (OSError, ValueError):
        state = {}
    if exit_code == SETUP_FAILED and "error" in state:
        raise SandboxError(f"cannot cut the network: {state['error']}")
    return str(state.get("network", "unknown"))


def _text(data: bytearray, max_chars: int) -> str:
    return data.decode("utf-8", errors="replace")[:max_chars]
