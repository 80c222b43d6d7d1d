"""The coordinator's end of the control plane: :class:`ControlServer`.

Threads (MPI initialised with ``THREAD_MULTIPLE``):
- *accept thread*: serves TCP knocks (:mod:`pearl.control.rendezvous`) and, for each
  admitted one, calls ``Accept`` on the open port. ``Accept`` is only called when a peer is
  about to ``Connect`` because a pending ``Accept`` stalls all other traffic (see
  :mod:`pearl.control.mpi`); while it runs, liveness checks are suspended. A peer that
  knocks and never connects (it died in between) would leave ``Accept`` pending forever:
  after ``accept_timeout_s`` a watchdog connects in its place and the connection, which
  never says hello, is dropped.
- *io thread*: the only thread that touches the intercommunicators. It receives and
  validates messages, answers ``Hello`` (token checked again, GPUs registered), sends
  heartbeats, declares an agent dead after ``missed_heartbeats`` intervals without any
  message from it (the end of its Slurm job reaches the state through the allocation
  backend), and sends the commands queued by :meth:`ControlServer.execute`.

One intercommunicator per agent; nothing collective is ever called on them, and a dead
peer's communicator is dropped locally, so losing one allocation blocks no other.

An agent is :class:`AgentState` ``alive`` from its ``Hello`` until it leaves (``gone``:
its ``Bye``, e.g. after a preemption) or is dropped (``dead``: silent, a broken channel, a
protocol error). A preemption is an event, not a state: the agent stays alive, and may
still acknowledge commands, until its ``Bye``. A command comes back with a
:class:`CommandStatus`. Attributes ending in ``_s`` are seconds: instants of this process's
``time.monotonic()`` (never compared across hosts), or durations where the comment says so.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

from pearl.control.channel import Channel
from pearl.control.messages import (
    Ack,
    Bye,
    Command,
    GpuInfo,
    Heartbeat,
    Hello,
    Preempted,
    ProtocolError,
    Welcome,
    WorkersExited,
)
from pearl.control.mpi import load_mpi
from pearl.control.portfile import PortInfo, new_token, remove_port_file, write_port_file
from pearl.control.rendezvous import ACCEPT_TIMEOUT_S, AcceptWatchdog, KnockListener

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 5.0


class AgentState(StrEnum):
    ALIVE = "alive"  # said hello; commands go to it
    GONE = "gone"  # said bye (after stopping its workers)
    DEAD = "dead"  # dropped: no heartbeat, a broken channel or a protocol error


class CommandStatus(StrEnum):
    """What became of a command, and of the plan step it carries out."""

    OK = "ok"  # acknowledged: done
    FAILED = "failed"  # acknowledged with an error: the agent could not do it
    TIMEOUT = "timeout"  # no ack within the command's deadline
    LOST = "lost"  # its agent is gone, dead or unknown (or the node has none)
    ABORTED = "aborted"  # a plan step never sent: a step it depends on did not succeed


@dataclass
class AgentInfo:
    agent_id: str
    node: str
    gpus: tuple[GpuInfo, ...]
    job_id: str | None
    pid: int
    state: AgentState = AgentState.ALIVE
    reason: str = ""
    last_seen_s: float = 0.0  # when its last message came
    grace_s: float | None = None  # of its preemption (a duration)
    workers: tuple[str, ...] = ()  # the workers it reported when it joined


class ServerEvent(NamedTuple):
    """One thing that happened to an agent: ``kind`` is joined, preempted, exited (some of
    its workers: ``workers``), gone, dead or refused."""

    kind: str
    agent_id: str
    detail: str
    workers: tuple[str, ...] = ()


@dataclass
class _Conn:
    channel: Channel
    opened_s: float
    agent_id: str | None = None
    hb_seq: int = 0
    last_hb_sent_s: float = 0.0


@dataclass
class _Pending:
    agent_id: str
    cmd: Command
    sent_s: float
    deadline_s: float  # when it times out: sent_s + cmd.deadline_s (a duration)
    ack: Ack | None = None
    failure: str | None = None


@dataclass(frozen=True)
class CommandResult:
    cmd_id: str
    agent_id: str
    ok: bool
    status: CommandStatus
    error: str | None
    elapsed_s: float
    url: str | None = None  # the engine's base URL its agent's ack reported (start, wake)


class ControlServer:
    def __init__(
        self,
        run_dir: str | Path,
        mpi: Any,
        knock: KnockListener,
        port: str,
        token: str,
        *,
        heartbeat_s: float = 0.5,
        missed_heartbeats: int = 6,
        accept_timeout_s: float = ACCEPT_TIMEOUT_S,
    ) -> None:
        """From what ``open`` made (MPI, the knock listener, the MPI port); no I/O."""
        self.run_dir = Path(run_dir)
        self.heartbeat_s = heartbeat_s
        self.missed_heartbeats = missed_heartbeats
        self.accept_timeout_s = accept_timeout_s
        self._mpi, self._knock, self.port, self._token = mpi, knock, port, token
        self._new_comms: queue.Queue[Any] = queue.Queue()
        self._outbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Condition()
        self._conns: dict[str, _Conn] = {}
        self._unauth: list[_Conn] = []
        self.agents: dict[str, AgentInfo] = {}
        self._pending: dict[str, _Pending] = {}
        self._events: list[ServerEvent] = []
        self._accepting_since_s: float | None = None
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._threads = [
            threading.Thread(target=self._accept_loop, name="control-accept", daemon=True),
            threading.Thread(target=self._io_loop, name="control-io", daemon=True),
        ]

    @classmethod
    def open(
        cls,
        run_dir: str | Path,
        *,
        heartbeat_s: float = 0.5,
        missed_heartbeats: int = 6,
        knock_host: str | None = None,
        token: str | None = None,
        accept_timeout_s: float = ACCEPT_TIMEOUT_S,
    ) -> ControlServer:
        """Initialise MPI, listen for knocks, open the MPI port, then ``start``."""
        mpi = load_mpi("multiple")
        token = token or new_token()
        knock = KnockListener(knock_host or socket.gethostname(), token)
        server = cls(
            run_dir,
            mpi,
            knock,
            mpi.Open_port(),
            token,
            heartbeat_s=heartbeat_s,
            missed_heartbeats=missed_heartbeats,
            accept_timeout_s=accept_timeout_s,
        )
        server.start()
        return server

    def start(self) -> None:
        """Write the port file the agents look for, and start accepting and serving."""
        write_port_file(
            self.run_dir,
            PortInfo(self.port, self._knock.host, self._knock.port, self._token, os.getpid()),
        )
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ public API
    def agents_snapshot(self) -> list[AgentInfo]:
        """Every agent known, copied under the lock (the io thread adds to them)."""
        with self._lock:
            return list(self.agents.values())

    def alive_agents(self) -> dict[str, AgentInfo]:
        with self._lock:
            return {a: i for a, i in self.agents.items() if i.state is AgentState.ALIVE}

    def agent_for_node(self, node: str) -> str | None:
        with self._lock:
            for a, i in self.agents.items():
                if i.node == node and i.state is AgentState.ALIVE:
                    return a
        return None

    def wait_for_agents(self, n: int, timeout_s: float) -> dict[str, AgentInfo]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while sum(i.state is AgentState.ALIVE for i in self.agents.values()) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{n} agents wanted, {len(self.alive_agents())} alive")
                self._lock.wait(left)
            return {a: i for a, i in self.agents.items() if i.state is AgentState.ALIVE}

    def events(self) -> list[ServerEvent]:
        """Agent events since the last call."""
        with self._lock:
            out, self._events = self._events, []
            return out

    def send_commands(self, cmds: Iterable[tuple[str, Command]]) -> None:
        now = time.monotonic()
        with self._lock:
            for agent_id, cmd in cmds:
                p = _Pending(agent_id, cmd, now, now + cmd.deadline_s)
                self._pending[cmd.cmd_id] = p
                info = self.agents.get(agent_id)
                if info is None or info.state is not AgentState.ALIVE:
                    p.failure = f"agent {agent_id} is {info.state if info else 'unknown'}"
                else:
                    self._outbox.put((agent_id, cmd))
            self._lock.notify_all()

    def wait_results(
        self, cmd_ids: Iterable[str], timeout_s: float | None = None, any_: bool = False
    ) -> dict[str, CommandResult]:
        """Block until all (or, with ``any_``, at least one) of ``cmd_ids`` are resolved."""
        ids = list(cmd_ids)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                done = {c: r for c in ids if (r := self._result(c)) is not None}
                if len(done) == len(ids) or (any_ and done):
                    for c in done:
                        self._pending.pop(c, None)
                    return done
                left = 0.05 if end is None else min(0.05, end - time.monotonic())
                if left <= 0:
                    return done
                self._lock.wait(left)

    def new_cmd_id(self) -> str:
        return f"c{next(self._ids)}"

    def close(self, restarting: bool = False) -> None:
        """Say Bye to live agents (``restarting``: that the next incarnation will take them
        over), stop the threads, close the port, remove the port file."""
        reason = "coordinator restarting" if restarting else "coordinator closing"
        with self._lock:
            for a, i in self.agents.items():
                if i.state is AgentState.ALIVE:
                    self._outbox.put((a, Bye(reason=reason, restarting=restarting)))
        time.sleep(min(0.2, self.heartbeat_s))
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for c in [*self._conns.values(), *self._unauth]:
            c.channel.close()
        self._knock.close()
        with contextlib.suppress(Exception):
            self._mpi.Close_port(self.port)
        remove_port_file(self.run_dir)

    # ------------------------------------------------------------------ internals
    def _result(self, cmd_id: str) -> CommandResult | None:
        p = self._pending.get(cmd_id)
        if p is None:
            return None
        elapsed = time.monotonic() - p.sent_s
        if p.ack is not None:
            status = CommandStatus.OK if p.ack.ok else CommandStatus.FAILED
            ack = p.ack
            return CommandResult(cmd_id, p.agent_id, ack.ok, status, ack.error, elapsed, ack.url)
        if p.failure is not None:
            lost = CommandStatus.LOST
            return CommandResult(cmd_id, p.agent_id, False, lost, p.failure, elapsed)
        if time.monotonic() > p.deadline_s + self.heartbeat_s:  # small slack for the ack trip
            msg = f"no ack within {p.cmd.deadline_s:.3g} s"
            timeout = CommandStatus.TIMEOUT
            return CommandResult(cmd_id, p.agent_id, False, timeout, msg, elapsed)
        return None

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                k = self._knock.poll()
            except Exception as e:  # the listener's threads contain each peer: keep going
                log.warning("knock listener: %s", e)
                time.sleep(0.5)
                continue
            if k is None:
                continue
            watchdog = AcceptWatchdog(self.port, self.accept_timeout_s)
            try:
                with self._lock:
                    self._accepting_since_s = time.monotonic()
                self._knock.admit(k)
                watchdog.start()
                comm = self._mpi.COMM_SELF.Accept(self.port)
                self._new_comms.put(comm)  # the unblocker's, if it fired: no hello, dropped
                if watchdog.fired:
                    log.warning("%s knocked but did not connect; unblocked", k.agent_id)
            except Exception as e:  # OSError, MPI's: one peer's accept, not the listener's
                log.warning("accept for %s failed: %s", k.agent_id, e)
            finally:
                watchdog.cancel()
                with self._lock:
                    # liveness clocks restart: nobody could talk while Accept was pending
                    stalled = time.monotonic() - (self._accepting_since_s or time.monotonic())
                    self._accepting_since_s = None
                    for i in self.agents.values():
                        i.last_seen_s += stalled
                k.conn.close()

    def _io_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._io_round()
            except Exception:  # one bad round must not end every connection's service
                log.exception("control io round failed")
                time.sleep(0.1)
        self._flush_byes()

    def _io_round(self) -> None:
        busy = False
        while not self._new_comms.empty():
            comm = self._new_comms.get()
            self._unauth.append(_Conn(Channel(self._mpi, comm), time.monotonic()))
        while not self._outbox.empty():
            agent_id, msg = self._outbox.get()
            conn = self._conns.get(agent_id)
            if conn is not None:
                conn.channel.send(msg)
                busy = True
        for conn in [*self._unauth, *self._conns.values()]:
            busy |= self._service(conn)
        self._heartbeats()
        if not busy:
            time.sleep(0.0003)

    def _flush_byes(self) -> None:
        end = time.monotonic() + 0.5
        while time.monotonic() < end and not all(
            c.channel.progress() for c in self._conns.values()
        ):
            time.sleep(0.001)

    def _service(self, conn: _Conn) -> bool:
        got = False
        for _ in range(64):
            try:
                msg = conn.channel.recv()
            except ProtocolError as e:
                self._drop(conn, AgentState.DEAD, f"protocol error: {e}")
                return True
            if msg is None:
                break
            got = True
            self._handle(conn, msg)
            if conn.channel.closed:
                return True
        conn.channel.progress()
        if conn.channel.error and not conn.channel.closed:
            self._drop(conn, AgentState.DEAD, conn.channel.error)
        elif conn.agent_id is None and time.monotonic() - conn.opened_s > HELLO_TIMEOUT_S:
            self._refuse(conn, "no hello")
        return got

    def _handle(self, conn: _Conn, msg: Any) -> None:
        now = time.monotonic()
        if conn.agent_id is None:
            if not isinstance(msg, Hello):
                self._refuse(conn, f"expected hello, got {msg.type}")
            elif not hmac.compare_digest(msg.token.encode(), self._token.encode()):
                conn.channel.send(Bye(reason="authentication failed: wrong token"))
                self._refuse(conn, f"{msg.agent_id}: wrong token", flush=True)
            else:
                self._register(conn, msg, now)
            return
        with self._lock:
            info = self.agents[conn.agent_id]
            info.last_seen_s = now
            if isinstance(msg, Ack):
                p = self._pending.get(msg.cmd_id)
                if p is not None and p.ack is None:
                    p.ack = msg
                    self._lock.notify_all()
            elif isinstance(msg, Preempted):
                info.grace_s = msg.grace_s
                self._event("preempted", info.agent_id, f"grace {msg.grace_s} s")
            elif isinstance(msg, WorkersExited):
                codes = ", ".join(f"{w} ({c})" for w, c in sorted(msg.exit_codes.items()))
                self._event("exited", info.agent_id, codes, tuple(sorted(msg.exit_codes)))
            elif isinstance(msg, Bye):
                self._drop(conn, AgentState.GONE, msg.reason or "bye")

    def _register(self, conn: _Conn, hello: Hello, now: float) -> None:
        with self._lock:
            old = self._conns.pop(hello.agent_id, None)
            if old is not None:  # a restarted agent replaces its stale connection
                old.channel.error = old.channel.error or "replaced"
                old.channel.close()
            self._unauth.remove(conn)
            self._retire_replaced(hello)
            conn.agent_id = hello.agent_id
            self._conns[hello.agent_id] = conn
            self.agents[hello.agent_id] = AgentInfo(
                hello.agent_id,
                hello.node,
                hello.gpus,
                hello.job_id,
                hello.pid,
                last_seen_s=now,
                workers=hello.workers,
            )
            self._event("joined", hello.agent_id, f"{hello.node} gpus={len(hello.gpus)}")
        conn.channel.send(
            Welcome(
                agent_id=hello.agent_id,
                heartbeat_s=self.heartbeat_s,
                missed_heartbeats=self.missed_heartbeats,
            )
        )

    def _retire_replaced(self, hello: Hello) -> None:
        """Marks gone, with no event, the live agents of ``hello``'s node and job that it
        replaces: an agent restarted by its job's payload joins under a new id while the
        old one may not yet have missed its heartbeats. Its ``dead`` event, later, would
        take the workers the new one starts (the ``joined`` event already accounts for
        the old one's: those the new one did not report are lost)."""
        for aid, info in self.agents.items():
            same = info.node == hello.node and info.job_id == hello.job_id
            if aid == hello.agent_id or not same or info.state is not AgentState.ALIVE:
                continue
            info.state, info.reason = AgentState.GONE, f"replaced by {hello.agent_id}"
            old = self._conns.pop(aid, None)
            if old is not None:
                old.channel.error = old.channel.error or info.reason
                old.channel.close()
            for p in self._pending.values():
                if p.agent_id == aid and p.ack is None and p.failure is None:
                    p.failure = f"agent {aid} {info.reason}"
            log.info("agent %s %s", aid, info.reason)

    def _refuse(self, conn: _Conn, reason: str, flush: bool = False) -> None:
        """Drop a connection that has not said a valid hello (event ``refused``)."""
        if flush:
            end = time.monotonic() + 0.2
            while not conn.channel.progress() and time.monotonic() < end:
                time.sleep(0.001)
        conn.channel.close()
        with self._lock:
            if conn in self._unauth:
                self._unauth.remove(conn)
                self._event("refused", "?", reason)

    def _drop(self, conn: _Conn, state: AgentState, reason: str) -> None:
        if state is AgentState.DEAD:
            conn.channel.error = conn.channel.error or reason
        conn.channel.close()
        with self._lock:
            if conn in self._unauth:
                self._unauth.remove(conn)
                self._event(state.value, "?", reason)
                return
            aid = conn.agent_id
            if aid is None or self._conns.get(aid) is not conn:
                return
            del self._conns[aid]
            info = self.agents[aid]
            info.state, info.reason = state, reason
            for p in self._pending.values():
                if p.agent_id == aid and p.ack is None and p.failure is None:
                    p.failure = f"agent {aid} {state}: {reason}"
            self._event(state.value, aid, reason)
            self._lock.notify_all()

    def _event(self, kind: str, agent_id: str, detail: str, workers: tuple[str, ...] = ()) -> None:
        log.info("agent %s %s: %s", agent_id, kind, detail)
        self._events.append(ServerEvent(kind, agent_id, detail, workers))
        self._lock.notify_all()

    def _heartbeats(self) -> None:
        now = time.monotonic()
        with self._lock:
            stalled = self._accepting_since_s is not None
        for aid, conn in list(self._conns.items()):
            if now - conn.last_hb_sent_s >= self.heartbeat_s:
                conn.last_hb_sent_s = now
                conn.channel.send(Heartbeat(seq=conn.hb_seq, t=time.time()))
                conn.hb_seq += 1
            if stalled:
                continue
            info = self.agents[aid]
            late = now - info.last_seen_s
            if late > self.heartbeat_s * self.missed_heartbeats:
                self._drop(conn, AgentState.DEAD, f"no heartbeat for {late:.2f} s")
