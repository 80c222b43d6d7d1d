"""``pearl coordinator CONFIG``: the persistent coordinator job (``pearl.coordinator.job``)."""

from __future__ import annotations

import argparse

from pearl.cli.flags import positive_seconds
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("coordinator", help="run the persistent coordinator of a run")
    p.add_argument("config", help="coordinator configuration (YAML or JSON)")
    p.add_argument(
        "--max-runtime-s", type=positive_seconds, default=None, help="stop after this long"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require("submitit")  # both backends submit through it (the slurm extra)
    from pearl.coordinator.job import run_job

    return run_job(args.config, args.max_runtime_s)
