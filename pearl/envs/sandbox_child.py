"""The sandbox's child: ``python -I [-S] sandbox_child.py LIMITS STATUS``, started by
``pearl.envs.sandbox`` in the run's working directory as pearl's own user (often root). It
isolates what the host permits, then runs ``main.py`` as ``__main__`` under the resource
limits, as a uid of its own when it is given one. Standard library only; it never imports
pearl.

Why it is shaped this way:

- Namespaces come from ``unshare`` (via ctypes: Python 3.11 has no ``os.unshare``). A new
  PID namespace holds the *children* of the caller only, so with one this process forks an
  init (PID 1 of the namespace: it mounts the namespace's ``/proc`` and reaps orphans), and
  the init forks the runner of the code. When the init ends, because the code ended or
  because it was killed with this process's group, the kernel kills everything left in the
  namespace, also what called ``setsid`` to leave the group.
- In the new mount namespace the whole tree is made read-only (one recursive
  ``mount_setattr``; one remount per mount on kernels before 5.12), then fresh tmpfs of
  ``tmpfs_bytes`` each are mounted over /tmp, /var/tmp, /dev/shm and the working directory
  (``main.py`` copied in): the only writable places, and they vanish with the namespace. A
  new IPC namespace takes the System V and POSIX message-queue objects with it as well.
- The code runs as a uid of its own (``setresuid``, supplementary groups dropped,
  ``no_new_privs`` so that no setuid binary gives root back) so that ``RLIMIT_NPROC``
  binds, which it never does for root, and file permissions hold where no mount namespace
  could be made. ``read_all`` keeps ``CAP_DAC_READ_SEARCH`` (read anything, write nothing
  more) for an interpreter other users cannot read, such as one under ``/root``.

LIMITS is a JSON object: ``network`` (auto | namespace | audit_hook), ``isolation`` (auto
| namespace | off), ``memory_bytes``, ``cpu_time_s``, ``file_bytes``, ``max_processes``,
``tmpfs_bytes``, ``uid`` (null: stay pearl's user) and ``read_all``. STATUS gets one JSON
object before the code runs: ``network``, ``isolation`` (namespace | none), ``uid`` and,
with a PID namespace, ``init_pid`` (the init's pid as the parent sees it); once the code
has ended there, ``exit_code`` is added (as ``subprocess`` spells it: negative for a
signal) and this process exits 0. When the sandbox cannot be set up as asked, STATUS gets
``{"error": ...}`` and the exit status is 125.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import re
import signal
import sys
import traceback
from typing import Any

SETUP_FAILED = 125
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable places, given fresh tmpfs
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 0x20, 0x400, 0x800, 0x1000
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 0x4000, 1 << 18, 1 << 21, 1 << 24
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
# mount_setattr's number in the unified syscall table (Linux 5.12+); other machines remount.
MOUNT_SETATTR = dict.fromkeys(("x86_64", "i686", "aarch64", "armv7l", "riscv64"), 442)
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 8, 38, 47
PR_CAP_AMBIENT_RAISE = 2
CAP_DAC_READ_SEARCH = 2
CAPABILITY_VERSION_3 = 0x20080522
BYTES_PER_INODE = 4096  # a tmpfs gets one inode per 4 KiB of its size: empty files cost too
# Per-mount flags a remount must keep (a mount locked in a user namespace refuses to lose them).
_KEPT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
# Events refused when no network namespace could be made (PEP 578 audit events).
_BLOCKED_PREFIXES = (
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "ctypes.dlopen",
    "ctypes.dlsym",
)


class SetupError(Exception):
    """The sandbox cannot be set up as asked (reported in STATUS, exit status 125)."""


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc with the prototypes of the calls made here: the kernel reads some arguments as
    64-bit (mount flags, prctl arguments, sizes), which ctypes would pass as C ints."""
    libc = ctypes.CDLL(None, use_errno=True)
    text, ulong = ctypes.c_char_p, ctypes.c_ulong
    libc.mount.argtypes = [text, text, text, ulong, ctypes.c_void_p]
    libc.prctl.argtypes = [ctypes.c_int, ulong, ulong, ulong, ulong]
    libc.syscall.argtypes = [ctypes.c_long, ctypes.c_int, text, ctypes.c_uint]
    libc.syscall.argtypes += [ctypes.c_void_p, ctypes.c_size_t]  # mount_setattr's
    libc.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libc.unshare.argtypes = [ctypes.c_int]
    return libc


def _check(result: int, what: str) -> None:
    """Raise ``OSError`` (errno kept) when a libc call returned nonzero."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int, what: str) -> str | None:
    """Enter new namespaces; the error when the kernel or the container refuses."""
    try:
        _check(_libc().unshare(flags), f"unshare({what})")
    except OSError as err:
        return str(err)
    return None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    def raw(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    result = _libc().mount(raw(source), raw(target), raw(fstype), flags, raw(data or None))
    _check(result, f"mount {target}")


def _mounts() -> list[tuple[str, str]]:
    """Mount point and per-mount options of every mount, parents first (mountinfo order)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        fields = [line.split() for line in f]
    octal = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, \ as \ooo
    return [(octal.sub(lambda m: chr(int(m[1], 8)), f[4]), f[5]) for f in fields]


def remount_each_read_only() -> None:
    """Make every mount of this mount namespace read-only and nosuid, one by one (kernels
    without ``mount_setattr``); a mount point hidden under a later mount is skipped."""
    for mount_point, options in _mounts():
        kept = sum(_KEPT_FLAGS.get(option, 0) for option in set(options.split(",")))
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept
        try:
            _mount(None, mount_point, None, flags, "")
        except FileNotFoundError:
            continue


def _read_only_everywhere() -> None:
    number = MOUNT_SETATTR.get(platform.machine())
    if number is not None:
        attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
        size = ctypes.sizeof(attr)
        if _libc().syscall(number, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), size) == 0:
            return
    remount_each_read_only()  # before 5.12, or a seccomp filter that does not know it


def _shared_tmp_dirs() -> list[str]:
    found: list[str] = []
    for path in SHARED_TMP:
        real = os.path.realpath(path)
        if os.path.isdir(real) and real not in found:
            found.append(real)
    return found


def _private_filesystem(work: str, source: str, limits: dict[str, Any]) -> None:
    """In the new mount namespace: nothing writable but fresh tmpfs over the shared
    temporary directories and over ``work`` (owned by the code's uid, ``main.py`` in it)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, "")  # nothing propagates back to the host
    _read_only_everywhere()
    size = limits["tmpfs_bytes"]
    tmpfs = f"size={size},nr_inodes={max(size // BYTES_PER_INODE, 64)}"
    for path in _shared_tmp_dirs():
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"{tmpfs},mode=1777")
    uid = os.getuid() if limits["uid"] is None else limits["uid"]
    gid = os.getgid() if limits["uid"] is None else limits["uid"]
    os.makedirs(work, exist_ok=True)  # again, when it lived under one of them
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"{tmpfs},mode=0700,uid={uid},gid={gid}")
    os.chdir(work)  # the new directory, not the read-only one under it
    with open("main.py", "w", encoding="utf-8") as f:
        f.write(source)
    os.chown("main.py", uid, gid)


def _isolate(limits: dict[str, Any], source: str) -> dict[str, Any]:
    """Make the namespaces asked for; what was made (STATUS's first object)."""
    network = "audit_hook"
    if limits["network"] != "audit_hook":
        error = _unshare(CLONE_NEWNET, "CLONE_NEWNET")
        if error is not None and limits["network"] == "namespace":
            raise SetupError(f"cannot cut the network: {error}")
        network = "namespace" if error is None else "audit_hook"
    isolation = "none"
    if limits["isolation"] != "off":
        error = _unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC, "CLONE_NEWPID|NEWNS|NEWIPC")
        if error is not None and limits["isolation"] == "namespace":
            raise SetupError(f"cannot isolate the processes and files: {error}")
        if error is None:
            try:
                _private_filesystem(os.getcwd(), source, limits)
            except OSError as err:  # the namespaces were made: a refusal now is no fallback
                raise SetupError(f"cannot set up the mounts: {err}") from err
            isolation = "namespace"
    return {"network": network, "isolation": isolation, "uid": limits["uid"]}


def _refuse(event: str, args: tuple[Any, ...]) -> None:
    if event.startswith(_BLOCKED_PREFIXES):
        raise PermissionError(f"sandbox: {event} is not allowed (no network)")


def _tasks_of(uid: int) -> int:
    """Processes and threads of ``uid`` now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status", encoding="utf-8") as f:
                lines = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if int(lines.get("Uid", "-1 -1").split()[0]) == uid:
            count += int(lines.get("Threads", "1"))
    return count


def _process_cap(max_processes: int, own_uid: bool) -> int:
    """``RLIMIT_NPROC``: the cap itself under a uid of its own (or root, where it does not
    bind); under another user's uid, on top of what that user runs already."""
    if own_uid or os.getuid() == 0:
        return max_processes
    return _tasks_of(os.getuid()) + max_processes


def _limit(limits: dict[str, Any]) -> None:
    import resource

    processes = _process_cap(limits["max_processes"], limits["uid"] is not None)
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if hard != resource.RLIM_INFINITY:
        processes = min(processes, hard)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_time_s"], limits["cpu_time_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def _only_capability(cap: int) -> None:
    """Keep ``cap`` alone (permitted, effective, inheritable and ambient, so that the
    code's own subprocesses keep it); every other capability is gone."""
    libc = _libc()
    bit = 1 << cap
    data = (_CapData * 2)(_CapData(bit, bit, bit), _CapData(0, 0, 0))
    _check(libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), data), "capset")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "ambient capability")


def _become(uid: int, read_all: bool) -> None:
    """Leave root for ``uid`` (also the gid), for good."""
    if read_all:
        _check(_libc().prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "keep capabilities")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if read_all:
        _only_capability(CAP_DAC_READ_SEARCH)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        raise OSError(f"still uid {os.getresuid()}, gid {os.getresgid()}")


def _run(source: str, limits: dict[str, Any], network: str) -> int:
    """Run the code here, as its uid and under its limits; its exit status."""
    _limit(limits)
    try:
        if limits["uid"] is not None:
            _become(limits["uid"], limits["read_all"])
        _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    except OSError as err:  # never run the code with privileges it was not meant to have
        print(f"sandbox: cannot drop privileges: {err}", file=sys.stderr)
        return SETUP_FAILED
    code = compile(source, "main.py", "exec")
    sys.argv = ["main.py"]
    if network == "audit_hook":
        sys.addaudithook(_refuse)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as err:  # the code's own failure: its traceback, our frame left out
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # type: ignore[union-attr]
        return 1
    return 0


def _write(fd: int, state: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(state).encode(), 0)


def _init(source: str, limits: dict[str, Any], network: str, report: int) -> int:
    """PID 1 of the namespace: mount its /proc, fork the runner, reap every child until
    the runner ends, and send its exit status up ``report``. Returning ends the namespace."""
    _libc().prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # the launcher died: so do we
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "")
        runner = os.fork()
    except OSError as err:
        os.write(report, json.dumps({"error": f"cannot start the namespace: {err}"}).encode())
        return SETUP_FAILED
    if runner == 0:
        os.close(report)
        raise SystemExit(_run(source, limits, network))  # the interpreter's own exit: flushed
    while True:
        pid, wait_status = os.wait()
        if pid == runner:
            break
    os.write(report, json.dumps({"exit_code": os.waitstatus_to_exitcode(wait_status)}).encode())
    return 0


def _supervise(source: str, limits: dict[str, Any], state: dict[str, Any], status: int) -> int:
    """With a PID namespace: fork its init, wait for it, and put the code's exit status
    into STATUS."""
    read_end, write_end = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(read_end)
        os.close(status)
        os._exit(_init(source, limits, state["network"], write_end))
    os.close(write_end)
    _write(status, state | {"init_pid": init})
    os.waitpid(init, 0)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    outcome = json.loads(report) if report else {"exit_code": -signal.SIGKILL}
    if "error" in outcome:
        _write(status, outcome)
        return SETUP_FAILED
    _write(status, state | outcome)
    return 0


def main() -> int:
    limits: dict[str, Any] = json.loads(sys.argv[1])
    status = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    try:
        state = _isolate(limits, source)
    except SetupError as err:
        _write(status, {"error": str(err)})
        return SETUP_FAILED
    if state["isolation"] == "namespace":
        return _supervise(source, limits, state, status)
    _write(status, state)
    os.close(status)
    return _run(source, limits, state["network"])


if __name__ == "__main__":
    sys.exit(main())
