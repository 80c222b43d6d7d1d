"""``pearl agent``: the node agent (``pearl.control.agent``), started in each allocation
under ``srun --mpi=pmi2`` or ``mpiexec -n 1``; ``pearl agent --help`` lists its options."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="run a node agent (inside an allocation)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="the agent's options")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pearl.control.agent import main  # MPI is initialised only for this command

    return main(args.args)
