"""TCP knock before ``MPI.Comm.Accept`` (see :mod:`pearl.control.mpi` for why).

The agent opens a TCP connection to the coordinator's knock address, sends one text line
``pearl-knock TOKEN 2 AGENT_ID`` and reads one JSON line back: ``{"ok": true}`` means the
coordinator is calling ``Accept`` now and the agent must ``Connect``; ``{"ok": false,
"error": ...}`` is a refusal (wrong token, a bad line). The line is plain words, not JSON,
so that the token is compared (in constant time) before anything else of it is parsed:
an unauthenticated peer gets no parser to attack beyond a read of at most ``MAX_LINE``
bytes and a split. A wrong token never reaches MPI at all; the token is checked again in
``Hello``. Knocks are
read concurrently, each within its own deadline, and whatever one peer sends is that
peer's failure only (:class:`KnockListener`); the admitted ones are served one at a time.

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
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pearl.control.mpi import find_mpiexec
from pearl.io.untrusted import UntrustedInput, loads_json

KNOCK_WORD = b"pearl-knock"
KNOCK_VERSION = 2  # 1: a JSON line (parsed before its token was checked)
KNOCK_TIMEOUT_S = 5.0
ACCEPT_TIMEOUT_S = 10.0  # an admitted peer connects within milliseconds
MAX_LINE = 4096
MAX_PENDING = 256  # knocks being read at once; more are told BUSY (the agent knocks again)
BUSY = "busy: too many knocks at once"
AGENT_ID = re.compile(r"[A-Za-z0-9][\w.:@+-]{0,127}", re.ASCII)  # NODE-JOBID-PID, or given

log = logging.getLogger(__name__)


class KnockRefused(RuntimeError):
    """The coordinator refused the knock (wrong token or bad request)."""


class KnockBusy(KnockRefused):
    """The coordinator is reading too many knocks at once: knock again shortly."""


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
    """Takes knocks on its own threads: one accepts connections, one per connection reads
    and checks its line (at most ``MAX_PENDING`` at once; more are closed unanswered), so
    a silent or slow peer holds only its own thread, for ``KNOCK_TIMEOUT_S`` at most. Any
    bytes at all are one peer's problem: whatever its handling raises (a line of deeply
    nested JSON raises ``RecursionError``) is contained, counted in ``refused`` and
    answered with a refusal where the connection still takes one. Knocks with the right
    token wait in a queue for :meth:`poll`."""

    def __init__(self, host: str, token: str, bind_host: str = "0.0.0.0") -> None:
        self._token = token
        self._sock = socket.create_server((bind_host, 0), backlog=128)
        self._sock.settimeout(0.1)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.refused = 0  # knocks refused or dropped: bad lines, wrong tokens, floods
        self._knocks: queue.Queue[Knock] = queue.Queue()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="knock-accept", daemon=True)
        self._acceptor.start()

    def poll(self) -> Knock | None:
        """Wait up to 0.1 s for a knock whose token is right."""
        try:
            return self._knocks.get(timeout=0.1)
        except queue.Empty:
            return None

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:  # closed, or out of file descriptors: keep listening
                if self._closed.is_set():
                    return
                log.warning("knock listener: %s", e)
                time.sleep(0.1)
                continue
            if not self._pending.acquire(blocking=False):  # a flood: this one waits for none
                self._refuse(conn, BUSY)
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            agent_id = self._check(conn)
        except Exception as e:  # any bytes: this peer's failure only
            self._refuse(conn, str(e) or type(e).__name__)
        else:
            self._knocks.put(Knock(conn, agent_id))
        finally:
            self._pending.release()

    def _check(self, conn: socket.socket) -> str:
        """The knock's agent id; ``ValueError`` (or whatever its bytes raise) if it is not a
        well-formed knock with the right token. The token is compared first."""
        words = _read_line(conn).split(b" ")
        if len(words) != 4 or words[0] != KNOCK_WORD:
            raise ValueError(f"not a knock line: expected {KNOCK_WORD.decode()} TOKEN V AGENT_ID")
        if not hmac.compare_digest(words[1], self._token.encode()):
            raise ValueError("authentication failed: wrong token")
        if words[2] != str(KNOCK_VERSION).encode():
            raise ValueError(f"unsupported knock version {words[2][:8]!r}, need {KNOCK_VERSION}")
        agent_id = words[3].decode("ascii", "replace")
        if not AGENT_ID.fullmatch(agent_id):
            raise ValueError(f"agent id {agent_id[:40]!r} is not of the form {AGENT_ID.pattern}")
        return agent_id

    def _refuse(self, conn: socket.socket, error: str) -> None:
        with self._lock:
            self.refused += 1
        with contextlib.suppress(OSError):
            conn.settimeout(0.5)
            conn.sendall(json.dumps({"ok": False, "error": error[:200]}).encode() + b"\n")
        conn.close()

    @staticmethod
    def admit(knock: Knock) -> None:
        knock.conn.sendall(b'{"ok": true}\n')

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._acceptor.join(timeout=1.0)
        while True:  # knocks admitted by nobody: their agents retry
            try:
                self._knocks.get_nowait().conn.close()
            except queue.Empty:
                return


def knock(host: str, port: int, token: str, agent_id: str) -> socket.socket:
    """Knock; return the open socket (close it once ``Connect`` returned)."""
    sock = socket.create_connection((host, port), timeout=KNOCK_TIMEOUT_S)
    sock.sendall(
        b" ".join([KNOCK_WORD, token.encode(), str(KNOCK_VERSION).encode(), agent_id.encode()])
    )
    sock.sendall(b"\n")
    try:
        reply = loads_json(_read_line(sock) or b"{}", max_bytes=MAX_LINE)
    except UntrustedInput as e:
        sock.close()
        raise KnockRefused(f"the coordinator's reply: {e}") from None
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        sock.close()
        error = str(reply.get("error") if isinstance(reply, dict) else reply)
        raise (KnockBusy if error == BUSY else KnockRefused)(error)
    return sock


def knock_until_admitted(
    host: str, port: int, token: str, agent_id: str, timeout_s: float
) -> socket.socket:
    """``knock``, again every 0.5 s while the coordinator is busy, for ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return knock(host, port, token, agent_id)
        except KnockBusy:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


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
