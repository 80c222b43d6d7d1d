"""The sandbox's child: run by ``python -I [-S] sandbox_child.py LIMITS STATUS`` in the
fresh working directory. It cuts the network, sets the resource limits, then runs
``main.py`` as ``__main__``. Standard library only; it never imports pearl.

LIMITS is a JSON object (``network``, ``memory_bytes``, ``cpu_time_s``, ``file_bytes``);
STATUS is a file the child writes ``{"network": "namespace" | "audit_hook"}`` to before
the code runs, or ``{"error": ...}`` (then exit status 125) when the network cannot be cut
as asked.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

CLONE_NEWNET = 0x40000000
SETUP_FAILED = 125
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


def _unshare_network() -> str | None:
    """Enter a new, empty network namespace (only a down loopback); the error if not."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}"
    return None


def _refuse(event: str, args: tuple[Any, ...]) -> None:
    if event.startswith(_BLOCKED_PREFIXES):
        raise PermissionError(f"sandbox: {event} is not allowed (no network)")


def _limit(memory_bytes: int, cpu_time_s: int, file_bytes: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_time_s, cpu_time_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def main() -> int:
    limits, status_path = json.loads(sys.argv[1]), sys.argv[2]
    error = None if limits["network"] == "audit_hook" else _unshare_network()
    if error is not None and limits["network"] == "namespace":
        with open(status_path, "w") as status:
            json.dump({"error": error}, status)
        return SETUP_FAILED
    network = (
        "audit_hook" if error is not None or limits["network"] == "audit_hook" else ("namespace")
    )
    with open(status_path, "w") as status:
        json.dump({"network": network}, status)
    _limit(limits["memory_bytes"], limits["cpu_time_s"], limits["file_bytes"])
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
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


if __name__ == "__main__":
    sys.exit(main())
