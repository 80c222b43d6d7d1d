"""The node agent (``pearl agent``): one per allocation, the coordinator's hands on a node.

It waits for the port file in the run directory, knocks (:mod:`pearl.control.rendezvous`),
``Connect``\\ s to the coordinator's port and sends ``Hello`` with the token and its GPUs.
Then one loop on the main thread (the only thread that calls MPI): receive commands and run
them on a thread pool against its :class:`~pearl.control.workers.Workers`, send their acks
(that of a start or a wake with the engine's URL, for the router), send a heartbeat every
``heartbeat_s``, and watch the coordinator's heartbeats. With each heartbeat it looks for
workers that died by themselves (``Workers.exited``: an engine killed or crashed) and
reports them (``WorkersExited``): the coordinator takes them out of its state and the
router, and the next plan may start others on their GPUs.

Preemption: SIGTERM or SIGUSR2 (Slurm's ``--signal``) -> ``Preempted(grace_s)``, stop the
workers within part of the grace period, ``Bye("preempted")``, drop the intercommunicator,
exit 0. A coordinator silent for ``missed_heartbeats`` intervals, or a ``Bye`` from it: stop
the workers and exit (3 and 0; 3 too for a ``Bye`` that says the coordinator is restarting,
so that the job's payload keeps the allocation for its next incarnation). A refused
``Hello``: exit 2.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Any

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
from pearl.control.mpi import find_mpiexec, load_mpi
from pearl.control.portfile import wait_port_file
from pearl.control.rendezvous import KnockRefused, knock_until_admitted
from pearl.control.workers import Workers
from pearl.core.plan import Action
from pearl.io.documents import InputError

EXIT_OK, EXIT_REFUSED, EXIT_LOST = 0, 2, 3
_JOINS = frozenset({Action.START, Action.WAKE})  # acks that report the engine's URL


def agent_command(run_dir: str | Path, node: str, *options: str) -> list[str]:
    """``pearl agent`` as an MPI process of its own (``mpiexec -n 1``; ``-launcher fork``
    keeps Hydra from calling ``srun`` when it runs inside a Slurm job step)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found next to the interpreter or on PATH")
    return [
        mpiexec,
        "-launcher",
        "fork",
        "-n",
        "1",
        sys.executable,
        "-m",
        "pearl.cli.agent",
        "--run-dir",
        str(run_dir),
        "--node",
        node,
        *options,
    ]


class Agent:
    def __init__(
        self,
        run_dir: str | Path,
        agent_id: str,
        node: str,
        gpus: list[GpuInfo],
        workers: Workers,
        *,
        grace_s: float = 30.0,
        job_id: str | None = None,
        connect_timeout_s: float = 60.0,
        log_dir: str | None = None,
    ) -> None:
        self.run_dir, self.agent_id, self.node, self.gpus = run_dir, agent_id, node, gpus
        self.workers, self.grace_s, self.job_id = workers, grace_s, job_id
        self.connect_timeout_s = connect_timeout_s
        self.log_dir = log_dir
        self._signal: str | None = None
        self._acks: queue.Queue[Ack] = queue.Queue()
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="cmd")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signal.Signals(signum).name

    def _say(self, line: str) -> None:
        """One line to stderr and, with a log directory, to ``agent-ID.log`` there: under
        ``mpiexec`` stderr goes through Hydra, which a preemption may take down first."""
        text = f"agent {self.agent_id}: {line}\n"
        with contextlib.suppress(OSError):
            sys.stderr.write(text)
            sys.stderr.flush()
        if self.log_dir is not None:
            path = os.path.join(self.log_dir, f"agent-{self.agent_id}.log")
            with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}")

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(sig, self._on_signal)
        mpi = load_mpi("funneled")
        try:
            info = wait_port_file(self.run_dir, self.connect_timeout_s)
            sock = knock_until_admitted(
                info.knock_host, info.knock_port, info.token, self.agent_id, self.connect_timeout_s
            )
        except KnockRefused as e:
            self._say(f"refused: {e}")
            return EXIT_REFUSED
        except InputError as e:  # a port file that is not one
            self._say(f"bad port file: {e}")
            return EXIT_REFUSED
        except OSError as e:  # no port file in time, or a stale one: no coordinator
            self._say(f"no coordinator: {e}")
            return EXIT_LOST
        try:
            comm = mpi.COMM_SELF.Connect(info.port)
        except mpi.Exception as e:
            self._say(f"connect failed: {e}")
            return EXIT_LOST
        finally:
            sock.close()
        ch = Channel(mpi, comm)
        ch.send(
            Hello(
                token=info.token,
                agent_id=self.agent_id,
                node=self.node,
                gpus=tuple(self.gpus),
                job_id=self.job_id,
                pid=os.getpid(),
                workers=self.workers.worker_ids(),
            )
        )
        try:
            return self._loop(ch)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            ch.close()

    def _run_cmd(self, cmd: Command) -> None:
        t0 = time.monotonic()
        try:
            self.workers.execute(cmd)
            url = self.workers.engine_url(cmd.worker_id) if cmd.action in _JOINS else None
            ack = Ack(cmd_id=cmd.cmd_id, ok=True, elapsed_s=time.monotonic() - t0, url=url)
        except Exception as e:  # every failure goes back as a failed ack
            ack = Ack(
                cmd_id=cmd.cmd_id,
                ok=False,
                error=f"{type(e).__name__}: {e}",
                elapsed_s=time.monotonic() - t0,
            )
        self._acks.put(ack)

    def _loop(self, ch: Channel) -> int:
        hb_s, missed = 0.5, 6
        welcomed = False
        last_seen_s = time.monotonic()
        last_hb_sent_s, seq = 0.0, 0
        while True:
            busy = False
            now = time.monotonic()
            if self._signal is not None:
                return self._preempted(ch, self._signal)
            try:
                msg = ch.recv()
            except ProtocolError as e:
                self._say(f"bad message: {e}")
                msg = None
            if msg is not None:
                busy, last_seen_s = True, now
                if isinstance(msg, Welcome):
                    welcomed, hb_s, missed = True, msg.heartbeat_s, msg.missed_heartbeats
                elif isinstance(msg, Command) and welcomed:
                    self._pool.submit(self._run_cmd, msg)
                elif isinstance(msg, Bye):
                    self.workers.stop_all(min(10.0, self.grace_s))
                    code = EXIT_OK if welcomed else EXIT_REFUSED
                    self._say(f"bye: {msg.reason}")
                    return EXIT_LOST if msg.restarting and welcomed else code
            while not self._acks.empty():
                ch.send(self._acks.get())
                busy = True
            if welcomed and now - last_hb_sent_s >= hb_s:
                ch.send(Heartbeat(seq=seq, t=time.time()))
                last_hb_sent_s, seq = now, seq + 1
                self._report_exited(ch)
            ch.progress()
            if ch.error or now - last_seen_s > hb_s * missed + (0 if welcomed else 10):
                why = ch.error or f"no message from the coordinator for {now - last_seen_s:.1f} s"
                self._say(f"coordinator lost: {why}")
                self.workers.stop_all(min(10.0, self.grace_s))
                return EXIT_LOST
            if not busy:
                time.sleep(0.0005)

    def _report_exited(self, ch: Channel) -> None:
        exited = self.workers.exited()
        if exited:
            codes = ", ".join(f"{w} ({c})" for w, c in sorted(exited.items()))
            self._say(f"workers exited by themselves: {codes}")
            ch.send(WorkersExited(exit_codes=exited))

    def _preempted(self, ch: Channel, signame: str) -> int:
        t0 = time.monotonic()
        ch.send(Preempted(grace_s=self.grace_s, signal=signame))
        ch.progress()
        self.workers.stop_all(self.grace_s * 0.6)
        ch.send(Bye(reason=f"preempted ({signame})"))
        end = t0 + self.grace_s * 0.9
        while not ch.progress() and time.monotonic() < end:
            time.sleep(0.001)
        self._say(f"preempted by {signame}, left after {time.monotonic() - t0:.2f} s")
        return EXIT_OK


def parse_gpus(spec: str, gpu_type: str, node: str) -> tuple[list[GpuInfo], dict[str, int]]:
    """``--gpus 0,1`` -> ids ``NODE/0``, ``NODE/1`` with local CUDA indices 0, 1."""
    gpus, index = [], {}
    for i, tok in enumerate(t for t in spec.split(",") if t):
        gid = tok if "/" in tok else f"{node}/{tok}"
        gpus.append(GpuInfo(id=gid, type=gpu_type))
        index[gid] = i
    return gpus, index
