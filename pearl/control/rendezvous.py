"""TCP knock before ``MPI.Comm.Accept`` (see :mod:`pearl.control.mpi` for why).

The agent opens a TCP connection to the coordinator's knock address, sends one JSON line
``{"v": 1, "token": ..., "agent_id": ...}`` and reads one JSON line back: ``{"ok": true}``
means the coordinator is calling ``Accept`` now and the agent must ``Connect``;
``{"ok": false, "error": ...}`` is a refusal (wrong token). A wrong token therefore never
reaches MPI at all; the token is checked again in ``Hello``. Knocks are served one at a
time; each one is bounded by a short socket timeout so a silent peer blocks nobody.

``AcceptWatchdog``: MPI has no timeout on ``Accept``, so when an admitted peer does not
connect within ``ACCEPT_TIMEOUT_S`` (it died after knocking), the watchdog starts a short
MPI process (``python -m pearl.control.rendezvous --unblock``) that connects to the port
and exits, which completes the pending ``Accept``. If the ``Accept`` completed first, the
unblocker is killed before it can take the next peer's ``Accept``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pearl.control.mpi import find_mpiexec

KNOCK_VERSION = 1
KNOCK_TIMEOUT_S = 5.0
ACCEPT_TIMEOUT_S = 10.0  # an admitted peer connects within milliseconds
MAX_LINE = 4096


class KnockRefused(RuntimeError):
    """The coordinator refused the knock (wrong token or bad request)."""


@dataclass(frozen=True)
class Knock:
    conn: socket.socket
    agent_id: str


def _read_line(sock: socket.socket) -> bytes:
    """One line within ``KNOCK_TIMEOUT_S`` in all (a peer trickling bytes cannot hold
    the listener longer)."""
    deadline = time.monotonic() + KNOCK_TIMEOUT_S
    data = b""
    while not data.endswith(b"\n"):
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("knock line not complete in time")
        sock.settimeout(remaining_s)
        chunk = sock.recv(MAX_LINE)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_LINE:
            raise ValueError("knock line too long")
    return data.strip()


class KnockListener:
    def __init__(self, host: str, token: str, bind_host: str = "0.0.0.0") -> None:
        self._token = token
        self._sock = socket.create_server((bind_host, 0))
        self._sock.settimeout(0.1)
        self.host = host
        self.port: int = self._sock.getsockname()[1]

    def poll(self) -> Knock | None:
        """Wait up to 0.1 s for one knock; return it if its token is right, else refuse it."""
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            return None
        conn.settimeout(KNOCK_TIMEOUT_S)
        try:
            req = json.loads(_read_line(conn))
            if not isinstance(req, dict) or req.get("v") != KNOCK_VERSION:
                raise ValueError("field 'v': unsupported knock version")
            token, agent_id = req.get("token"), req.get("agent_id")
            if not isinstance(token, str) or not isinstance(agent_id, str) or not agent_id:
                raise ValueError("fields 'token'/'agent_id' must be strings")
            if not hmac.compare_digest(token.encode(), self._token.encode()):
                raise ValueError("authentication failed: wrong token")
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"ok": False, "error": str(e)}).encode() + b"\n")
            conn.close()
            return None
        return Knock(conn, agent_id)

    @staticmethod
    def admit(knock: Knock) -> None:
        knock.conn.sendall(b'{"ok": true}\n')

    def close(self) -> None:
        self._sock.close()


def knock(host: str, port: int, token: str, agent_id: str) -> socket.socket:
    """Knock; return the open socket (close it once ``Connect`` returned)."""
    sock = socket.create_connection((host, port), timeout=KNOCK_TIMEOUT_S)
    sock.sendall(json.dumps({"v": KNOCK_VERSION, "token": token, "agent_id": agent_id}).encode())
    sock.sendall(b"\n")
    reply = json.loads(_read_line(sock) or b"{}")
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        sock.close()
        raise KnockRefused(str(reply.get("error") if isinstance(reply, dict) else reply))
    return sock


class AcceptWatchdog:
    """Completes a pending ``Accept`` on ``port`` if nobody connects within ``timeout_s``."""

    def __init__(self, port: str, timeout_s: float) -> None:
        self.port, self.fired = port, False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._proc: subprocess.Popen[bytes] | None = None
        self._cancelled = False
        self._lock = threading.Lock()

    def start(self) -> None:
        self._timer.start()

    def _fire(self) -> None:
        mpiexec = find_mpiexec()
        if mpiexec is None:
            return
        cmd = [mpiexec, "-launcher", "fork", "-n", "1", sys.executable, "-m", __name__]
        with self._lock:
            if self._cancelled:  # the Accept returned meanwhile: no unblocker
                return
            self.fired = True
            self._proc = subprocess.Popen(
                [*cmd, "--unblock", self.port], stdin=subprocess.DEVNULL, start_new_session=True
            )

    def cancel(self) -> None:
        """The ``Accept`` returned: stop the timer, and an unblocker still connecting."""
        self._timer.cancel()
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout=2.0)  # it connected (that is why Accept returned) and exits
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


def _unblock(port: str) -> int:
    from pearl.control.mpi import load_mpi

    mpi = load_mpi("single")
    mpi.COMM_SELF.Connect(port)
    os._exit(0)  # no Disconnect: it is collective, and the other side never answers


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--unblock":
        sys.exit(_unblock(sys.argv[2]))
    print("usage: python -m pearl.control.rendezvous --unblock PORT", file=sys.stderr)
    sys.exit(2)
