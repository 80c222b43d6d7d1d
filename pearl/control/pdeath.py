"""``python -m pearl.control.pdeath PARENT_PID CMD [ARG ...]``: run CMD so that it gets
SIGTERM when its parent, the process ``PARENT_PID`` that started it, dies, even by SIGKILL
(Linux ``PR_SET_PDEATHSIG``, which ``execve`` keeps).

The agent starts every engine through it, so no engine outlives the agent that manages
its GPUs. It is a separate process rather than a ``preexec_fn`` because the agent has
threads, and code run between ``fork`` and ``exec`` of a threaded process may deadlock.
If the parent is not ``PARENT_PID`` once the signal is armed (it died before, maybe even
before this process got to run), it exits instead of starting CMD.
Elsewhere than Linux it only runs CMD.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def command(argv: list[str]) -> list[str]:
    """``argv`` to be run by this process's child, wrapped so that it dies with us."""
    return [sys.executable, "-m", __name__, str(os.getpid()), *argv]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m pearl.control.pdeath PARENT_PID CMD [ARG ...]", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[1:]
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            print(f"pdeath: prctl: errno {ctypes.get_errno()}", file=sys.stderr)
            return 1
    if os.getppid() != parent:  # the parent died before the signal was armed
        return 1
    os.execvp(cmd[0], cmd)  # does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
