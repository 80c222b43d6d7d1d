"""A Python tool sandbox: the model's code runs in a fresh subprocess under limits, and
hostile code (fork bombs, memory hogs, endless loops, writes outside its directory,
network attempts) stays inside them.

Each ``Sandbox.run(code)`` writes ``code`` to ``main.py`` in a new temporary directory,
starts ``sys.executable -I [-S] sandbox_child.py`` there in its own session (process
group), and returns a ``SandboxResult``; ``render`` turns it into the observation text.
A timeout, a memory blow-up or a crash is a result, never an exception to the caller; only
a sandbox that cannot be set up as configured raises ``SandboxError``.

What is enforced, and how (``docs/envs.md``, "The Python sandbox", has the whole table):

- who: when pearl is root (as in clusters' containers), the code runs as a uid and gid of
  its own, drawn for each run from ``uid_count`` uids at ``uid_min`` and reserved with an
  abstract unix socket, so that ``RLIMIT_NPROC`` binds (it never binds root), file
  permissions hold, and whatever is left of a run can be found and killed by its uid;
- processes: ``RLIMIT_NPROC`` of ``max_processes`` (threads count) for that uid; a new PID
  namespace whose init's end kills every descendant, also one that left the process group
  with ``setsid``; after every run the parent kills what still runs as the uid;
- files: a new mount namespace where all is read-only but fresh tmpfs of ``tmpfs_mb``
  over the working directory, /tmp, /var/tmp and /dev/shm (gone with the namespace);
  ``RLIMIT_FSIZE`` of ``max_file_mb`` per file; no core dumps;
- wall clock: ``timeout_s``, then SIGKILL to the process group (and so to the namespace);
  the call returns at most ``SWEEP_S + DRAIN_AFTER_KILL_S`` later, plus the time it takes
  to remove the directory;
- CPU time: ``RLIMIT_CPU`` (soft ``cpu_time_s``: SIGXCPU; hard one second later: SIGKILL);
- memory: ``RLIMIT_AS`` of ``memory_mb`` per process (allocations fail with
  ``MemoryError``);
- network: a new network namespace with only a down loopback; where that is refused, PEP
  578 audit hooks refuse sockets, subprocesses, forks and ctypes (best effort);
- output: stdout and stderr each kept to ``max_output_chars`` (the rest is read and
  dropped), the observation cut to the same limit;
- interpreter: ``-I``, ``-S`` unless ``site_packages: true``; stdin is empty.

The uid of its own, the namespaces and the network namespace each fall back where the host
refuses them (pearl not root, no ``CAP_SYS_ADMIN``, a seccomp filter) unless made
mandatory (``user: drop``, ``isolation: namespace``, ``network: namespace``);
``SandboxResult`` says what a run had. The uid of its own, its checks and the sweep after a
run are ``pearl.envs.sandbox_uids``. Not enforced even with all of them: reading the
host's files; the memory of all processes together (up to ``max_processes`` times
``memory_mb``, plus the tmpfs). Without the mount namespace: writes to world-writable
places other than /tmp, /var/tmp and /dev/shm (those are swept of the uid's files), and
the number of files in the working directory. As root without a uid of its own: the
number of processes; with neither that nor a PID namespace: a child that calls
``setsid`` (its pipes are given up after ``DRAIN_AFTER_KILL_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from pearl.core.state import Frozen
from pearl.envs.sandbox_uids import (
    OwnUid,
    SandboxError,
    interpreter,
    own_uid,
    remove_files_of,
    sweep,
)

__all__ = ["Sandbox", "SandboxConfig", "SandboxError", "SandboxResult", "render"]

CHILD = Path(__file__).with_name("sandbox_child.py")
SETUP_FAILED = 125  # sandbox_child's status when the sandbox cannot be set up as asked
SWEEP_S = 1.0  # the longest the parent waits for, and kills, what is left of a run
DRAIN_AFTER_KILL_S = 1.0  # how long to wait for the pipes once the processes are dead
_CHUNK = 65536
log = logging.getLogger(__name__)


class SandboxConfig(Frozen):
    timeout_s: float = Field(5.0, gt=0, le=600, description="Wall-clock limit of one run.")
    cpu_time_s: int = Field(5, ge=1, le=600, description="CPU-time limit (RLIMIT_CPU).")
    memory_mb: int = Field(
        512, ge=64, le=65536, description="Address-space limit (RLIMIT_AS) per process, MiB."
    )
    max_file_mb: int = Field(16, ge=1, le=4096, description="Largest file it may write, MiB.")
    max_output_chars: int = Field(
        2000, ge=100, le=1_000_000, description="Characters of output kept for the model."
    )
    max_processes: int = Field(
        16,
        ge=1,
        le=1024,
        description="Processes and threads the code may have at once (RLIMIT_NPROC of its "
        "uid; binds only under a uid of its own or a non-root user).",
    )
    network: Literal["auto", "namespace", "audit_hook"] = Field(
        "auto",
        description="How the network is cut: a network namespace when permitted, else audit "
        "hooks (auto); the namespace or fail (namespace); audit hooks only (audit_hook).",
    )
    isolation: Literal["auto", "namespace", "off"] = Field(
        "auto",
        description="PID, mount and IPC namespaces (every process dies with the run, the "
        "filesystem is read-only but fresh tmpfs): when permitted (auto); those or fail "
        "(namespace); never (off).",
    )
    user: Literal["auto", "drop", "keep"] = Field(
        "auto",
        description="Who runs the code: a uid of its own when pearl is root and may change "
        "uids (auto); a uid of its own or fail (drop); pearl's own user (keep).",
    )
    uid_min: int = Field(
        60000, ge=1, le=2**31, description="First of the uids (and gids) runs are given."
    )
    uid_count: int = Field(
        5000, ge=1, le=2**20, description="How many uids from uid_min on runs are given."
    )
    tmpfs_mb: int = Field(
        64,
        ge=1,
        le=4096,
        description="Size of each fresh tmpfs (working directory, /tmp, /var/tmp, /dev/shm) "
        "under isolation, MiB; they are memory.",
    )
    site_packages: bool = Field(
        False, description="Let the code import installed packages (drops python -S)."
    )


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # None when killed by the timeout
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    duration_s: float
    network: str  # how the network was cut: namespace | audit_hook
    isolation: str = "none"  # namespace: PID, mount and IPC namespaces; none
    uid: int | None = None  # the uid of its own it ran as; None: pearl's user
    contained: bool = True  # nothing of the run was left running when it returned

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code >= 0:
            return None
        return signal.Signals(-self.exit_code).name


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()

    async def run(self, code: str) -> SandboxResult:
        c = self.config
        own = await own_uid(c.user, c.uid_min, c.uid_count, c.site_packages)
        root = Path(tempfile.mkdtemp(prefix="pearl-sandbox-"))
        try:
            work = root / "work"
            work.mkdir()
            (work / "main.py").write_text(code, encoding="utf-8")
            if own is not None:  # its own directory, reachable through the root one
                root.chmod(0o711)
                os.chown(work, own.uid, own.uid)
                os.chown(work / "main.py", own.uid, own.uid)
            return await self._run_in(work, root / "status.json", own)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if own is not None:
                own.lock.close()

    async def _run_in(self, work: Path, status: Path, own: OwnUid | None) -> SandboxResult:
        c = self.config
        limits = {
            "network": c.network,
            "isolation": c.isolation,
            "memory_bytes": c.memory_mb * 2**20,
            "cpu_time_s": c.cpu_time_s,
            "file_bytes": c.max_file_mb * 2**20,
            "max_processes": c.max_processes,
            "tmpfs_bytes": c.tmpfs_mb * 2**20,
            "uid": None if own is None else own.uid,
            "read_all": own is not None and own.read_all,
        }
        flags = ["-I"] if c.site_packages else ["-I", "-S"]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            interpreter(c.site_packages),
            *flags,
            str(CHILD),
            json.dumps(limits),
            str(status),
            cwd=work,
            env=_environment(work),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        out, err = bytearray(), bytearray()
        assert proc.stdout is not None and proc.stderr is not None
        limit = c.max_output_chars * 4  # bytes: a character is at most 4 of them in UTF-8
        drains = asyncio.gather(_drain(proc.stdout, out, limit), _drain(proc.stderr, err, limit))
        pidfd = _pidfd(proc.pid)
        timed_out = False
        try:
            await asyncio.wait_for(_exited(proc, pidfd), c.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:  # also when the caller is cancelled: nothing of the run outlives it
            _kill_group(proc.pid)
            await _exited(proc, pidfd)
            if pidfd is not None:
                os.close(pidfd)
            ended = time.monotonic()
            state = _read_state(status)
            contained = await _contain(state, own)
        try:
            over = tuple(await asyncio.wait_for(drains, DRAIN_AFTER_KILL_S))
        except TimeoutError:  # something escaped and holds the pipes
            over = (True, True)
        returncode = await _returncode(proc)
        exit_code = _exit_code(state, returncode)
        return SandboxResult(
            exit_code=None if timed_out else exit_code,
            stdout=_text(out, c.max_output_chars),
            stderr=_text(err, c.max_output_chars),
            timed_out=timed_out,
            output_truncated=any(over) or len(out) > limit or len(err) > limit,
            duration_s=ended - start,
            network=str(state.get("network", "unknown")),
            isolation=str(state.get("isolation", "unknown")),
            uid=None if own is None else own.uid,
            contained=contained,
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


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:  # before Linux 5.3
        return None


async def _exited(proc: asyncio.subprocess.Process, pidfd: int | None) -> None:
    """Return once the child has exited. Not ``proc.wait()``: that also waits for the
    pipes to close, which a descendant that left the process group may hold open."""
    if pidfd is None:
        while proc.returncode is None:
            await asyncio.sleep(0.01)
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


async def _returncode(proc: asyncio.subprocess.Process) -> int | None:
    """The exited child's status, once asyncio's child watcher has reaped it."""
    end = time.monotonic() + DRAIN_AFTER_KILL_S
    while proc.returncode is None and time.monotonic() < end:
        await asyncio.sleep(0.005)
    return proc.returncode


def _environment(work: Path) -> dict[str, str]:
    """The code's whole environment; numeric libraries get one thread each, as threads
    count against ``max_processes``."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    env |= {"HOME": str(work), "TMPDIR": str(work)}
    return env | dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")


def _read_state(status: Path) -> dict[str, Any]:
    try:
        state = json.loads(status.read_text())
    except (OSError, ValueError):  # killed before it wrote, or a torn write
        return {}
    return state if isinstance(state, dict) else {}


def _exit_code(state: dict[str, Any], returncode: int | None) -> int | None:
    """The code's exit status: the child's own, or the one it reported from a PID
    namespace; raises ``SandboxError`` when the child could not set the sandbox up."""
    if returncode == SETUP_FAILED and "error" in state:
        raise SandboxError(str(state["error"]))
    code = state.get("exit_code", returncode)
    return code if isinstance(code, int) else returncode


async def _contain(state: dict[str, Any], own: OwnUid | None) -> bool:
    """After the process group is dead: wait for the namespace to end and kill whatever
    still runs as the run's uid (within ``SWEEP_S``); without a mount namespace, remove the
    uid's files from the shared temporary directories. Whether nothing was left running."""
    init = state.get("init_pid") if state.get("isolation") == "namespace" else None
    uid = None if own is None else own.uid
    if uid is None and not isinstance(init, int):
        return True
    contained = await asyncio.to_thread(
        sweep, uid, init if isinstance(init, int) else None, SWEEP_S
    )
    if uid is not None and state.get("isolation") != "namespace":
        await asyncio.to_thread(remove_files_of, uid)
    if not contained:
        log.warning("sandbox: processes of uid %s outlived the run", uid)
    return contained


def _text(data: bytearray, max_chars: int) -> str:
    return data.decode("utf-8", errors="replace")[:max_chars]
