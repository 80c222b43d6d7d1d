"""``pearl agent``: the node agent (``pearl.control.agent``), started in each allocation
under ``srun --mpi=pmi2`` or ``mpiexec -n 1`` (``pearl.control.agent.agent_command``).

Allocations start it as ``python -m pearl.cli.agent ...`` (``main``), which parses the same
options without importing the other commands (the simulator, the analysis): an agent
starts fast and depends on no more of pearl than it uses."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys

from pearl.cli.errors import run_command
from pearl.control.rendezvous import AGENT_ID
from pearl.io.documents import InputError
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="run a node agent (inside an allocation)")
    add_options(p)
    p.set_defaults(run=run)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="run directory holding control/port.json")
    p.add_argument("--agent-id", default=None, help="default: NODE-JOBID-PID")
    p.add_argument("--node", default=os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    p.add_argument(
        "--gpus",
        default=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        help="comma-separated local GPU indices or NODE/INDEX ids",
    )
    p.add_argument("--gpu-type", default="h100")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ROLE=CMD",
        help="engine argv per role ('*' for any); {port} {kv_port} {role} {worker_id}",
    )
    p.add_argument(
        "--null-workers",
        action="store_true",
        help="record commands without launching anything (benchmarks)",
    )
    p.add_argument(
        "--job-id",
        default=os.environ.get("SLURM_JOB_ID"),
        help="the scheduler's job the agent runs in (default: SLURM_JOB_ID)",
    )
    p.add_argument(
        "--engine-host",
        default="127.0.0.1",
        help="the address its engines listen on and their URLs name (the node's name: "
        "reachable from other nodes); default loopback",
    )
    p.add_argument("--grace-s", type=float, default=30.0)
    p.add_argument("--connect-timeout-s", type=float, default=60.0)
    p.add_argument("--log-dir", default=None, help="the agent's and its engines' logs")


def run(args: argparse.Namespace) -> int:
    require("mpi4py")  # MPI is initialised only for this command (the slurm extra)
    from pearl.control.agent import Agent, parse_gpus
    from pearl.control.workers import NullWorkers, ProcessWorkers, Workers

    gpus, index = parse_gpus(args.gpus, args.gpu_type, args.node)
    workers: Workers
    if args.null_workers:
        workers = NullWorkers()
    else:
        commands = {}
        for spec in args.engine:
            role, _, cmd = spec.partition("=")
            commands[role] = shlex.split(cmd)
        workers = ProcessWorkers(commands, index, log_dir=args.log_dir, host=args.engine_host)
    agent_id = args.agent_id or f"{args.node}-{args.job_id or 'local'}-{os.getpid()}"
    if not AGENT_ID.fullmatch(agent_id):
        problem = f"{agent_id!r} is not of the form {AGENT_ID.pattern}"
        raise InputError("pearl agent", "--agent-id", problem)
    agent = Agent(
        args.run_dir,
        agent_id,
        args.node,
        gpus,
        workers,
        grace_s=args.grace_s,
        job_id=args.job_id,
        connect_timeout_s=args.connect_timeout_s,
        log_dir=args.log_dir,
    )
    return agent.run()


def main(argv: list[str] | None = None) -> int:
    """``python -m pearl.cli.agent``: ``pearl agent`` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="pearl agent", description=__doc__.splitlines()[0])
    add_options(parser)
    parser.set_defaults(run=run)
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
