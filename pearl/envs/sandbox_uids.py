"""The sandbox's uid of its own (``pearl.envs.sandbox``): one drawn for each run and
reserved with an abstract unix socket, the checks that one can be used (pearl is root with
the capabilities it needs, the uid is mapped, has no account and no process, and can start
the interpreter), and what the parent does after a run: kill what still runs as the uid
and remove its files from the shared temporary directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # as in sandbox_child: world-writable places
PROBE_TIMEOUT_S = 30.0  # for the one check whether a fresh uid can start the interpreter
# What changing to the run's uid and cleaning up after it take (bits of CapEff).
_NEEDED_CAPS = {0: "CAP_CHOWN", 5: "CAP_KILL", 6: "CAP_SETGID", 7: "CAP_SETUID"}
CAP_DAC_READ_SEARCH = 2
_PROBE = "import json, decimal, ctypes, multiprocessing"
_PROBE_SITE = "; import os, site; [os.listdir(p) for p in site.getsitepackages()]"
# Per interpreter and ``site_packages``: whether a uid without any rights can start it.
_READABLE_BY_OTHERS: dict[tuple[str, bool], bool] = {}


class SandboxError(RuntimeError):
    """The sandbox could not be set up as configured (not the code's fault)."""


@dataclass
class OwnUid:
    """A uid (and the gid of the same number) reserved for one run while ``lock`` is open."""

    uid: int
    read_all: bool  # the interpreter is unreadable to others: keep CAP_DAC_READ_SEARCH
    lock: socket.socket


def _proc_status(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except (OSError, ValueError):
        return {}


def _runs_as(fields: dict[str, str], uid: int) -> bool:
    ids = fields.get("Uid", "").split()
    return len(ids) >= 2 and uid in (int(ids[0]), int(ids[1]))  # real or effective


def _live(fields: dict[str, str]) -> bool:
    return bool(fields) and not fields.get("State", "").startswith(("Z", "X"))


def _pids_of(uid: int, live_only: bool) -> list[int]:
    """The processes running as ``uid`` (really or effectively), from ``/proc``."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _proc_status(name)
            if _runs_as(fields, uid) and (_live(fields) or not live_only):
                pids.append(int(name))
    return pids


def _kill_if_runs_as(pid: int, uid: int) -> None:
    """SIGKILL ``pid`` if it still runs as ``uid``; through a pidfd where the kernel has
    them, so that a pid reused by another process in the meantime is never hit."""
    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # before Linux 5.3
        handle = None
    try:
        if not _runs_as(_proc_status(str(pid)), uid):
            return
        if handle is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(handle, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        if handle is not None:
            os.close(handle)


def sweep(uid: int | None, init_pid: int | None, within_s: float) -> bool:
    """Kill every live process of ``uid`` and wait for the namespace's init to be gone,
    until none is left or ``within_s`` has passed; whether none is left."""
    end = time.monotonic() + within_s
    while True:
        pids = [] if uid is None else _pids_of(uid, live_only=True)
        waiting = init_pid is not None and _live(_proc_status(str(init_pid)))
        if not pids and not waiting:
            return True
        if time.monotonic() >= end:
            return False
        for pid in pids:
            _kill_if_runs_as(pid, uid)  # type: ignore[arg-type]  # pids is empty without uid
        time.sleep(0.005)


def remove_files_of(uid: int) -> None:
    """Remove what ``uid`` made at the top of the shared temporary directories (the only
    places, with other world-writable ones, where a uid of its own can write)."""
    for folder in dict.fromkeys([*SHARED_TMP, tempfile.gettempdir()]):
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)


def _capabilities() -> int:
    """This process's effective capabilities (a bit mask)."""
    return int(_proc_status("self").get("CapEff", "0"), 16)


def _why_not_own_uid() -> str | None:
    if os.geteuid() != 0:
        return "pearl does not run as root"
    missing = [name for bit, name in _NEEDED_CAPS.items() if not _capabilities() >> bit & 1]
    return f"pearl lacks {', '.join(missing)}" if missing else None


def _mapped(number: int, kind: Literal["uid", "gid"]) -> bool:
    """Whether ``number`` exists in this user namespace (a rootless container maps few)."""
    try:
        with open(f"/proc/self/{kind}_map", encoding="utf-8") as f:
            ranges = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        return True
    return any(first <= number < first + count for first, _, count in ranges)


def _has_account(number: int) -> bool:
    try:
        pwd.getpwuid(number)
    except KeyError:
        try:
            grp.getgrgid(number)
        except KeyError:
            return False
    return True


def _reserve_uid(first: int, count: int) -> tuple[int, socket.socket] | None:
    """A uid no account, no group and no process has, reserved against other sandboxes
    (of this host's network namespace) by binding an abstract unix socket named after it."""
    for _ in range(min(count, 32)):
        uid = first + random.randrange(count)
        if not (_mapped(uid, "uid") and _mapped(uid, "gid")):
            continue
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            lock.bind(f"\0pearl-sandbox-uid-{uid}")
        except OSError:
            lock.close()
            continue
        if _has_account(uid) or _pids_of(uid, live_only=False):
            lock.close()
            continue
        return uid, lock
    return None


def interpreter(site_packages: bool) -> str:
    """The Python the sandboxed code runs (its ``sys.executable``). Without site-packages,
    the real binary rather than a virtual environment's link: a venv under ``/tmp`` (a
    clone there) vanishes under the run's fresh ``/tmp``, and with it ``sys.executable``
    (``subprocess.run([sys.executable, ...])`` in the code failed). With site-packages
    the venv's own (its packages are the point; one under ``/tmp`` is then hidden)."""
    return sys.executable if site_packages else os.path.realpath(sys.executable)


async def _readable_by(uid: int, site_packages: bool) -> bool:
    """Whether ``uid``, without any capability, can start this interpreter and import
    from it (checked once per process: an interpreter under ``/root`` cannot be)."""
    key = (interpreter(site_packages), site_packages)
    if key not in _READABLE_BY_OTHERS:
        flags = ["-I"] if site_packages else ["-I", "-S"]
        probe = _PROBE + (_PROBE_SITE if site_packages else "")
        try:
            proc = await asyncio.create_subprocess_exec(
                *(interpreter(site_packages), *flags, "-c", probe),
                user=uid,
                group=uid,
                extra_groups=[],
                cwd="/",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            _READABLE_BY_OTHERS[key] = False
        else:
            try:
                _READABLE_BY_OTHERS[key] = await asyncio.wait_for(proc.wait(), PROBE_TIMEOUT_S) == 0
            except TimeoutError:
                proc.kill()
                await proc.wait()
                _READABLE_BY_OTHERS[key] = False
    return _READABLE_BY_OTHERS[key]


async def own_uid(
    user: Literal["auto", "drop", "keep"], uid_min: int, uid_count: int, site_packages: bool
) -> OwnUid | None:
    """The run's own uid, per ``user`` (``SandboxConfig``'s fields); None to run as pearl's
    user. Raises ``SandboxError`` when ``user: drop`` cannot be honoured."""
    if user == "keep":
        return None
    why = _why_not_own_uid()
    reserved = None if why else _reserve_uid(uid_min, uid_count)
    if why is None and reserved is None:
        why = f"no free uid among {uid_count} from {uid_min}"
    if reserved is not None:
        uid, lock = reserved
        try:
            readable = await _readable_by(uid, site_packages)
        except BaseException:  # cancelled meanwhile
            lock.close()
            raise
        if readable or _capabilities() >> CAP_DAC_READ_SEARCH & 1:
            return OwnUid(uid, read_all=not readable, lock=lock)
        lock.close()
        why = "other users cannot read the interpreter, and pearl lacks CAP_DAC_READ_SEARCH"
    if user == "drop":
        raise SandboxError(f"cannot run the code as a uid of its own: {why}")
    return None
