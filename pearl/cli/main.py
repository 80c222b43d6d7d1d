"""The ``pearl`` command: subcommands register themselves; input errors exit with 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pearl.cli import (
    agent,
    analyze,
    bench,
    coordinator,
    engine,
    family,
    model,
    plan,
    profile,
    run,
    simulate,
    sweep,
    trainer,
)
from pearl.cli.errors import run_command
from pearl.cli.flags import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="pearl",
        description="Asynchronous agentic RL on Slurm: elastic GPUs, borrowed training GPUs "
        "and adaptive prefill-decode rollout.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_parser(sub)
    bench.add_parser(sub)
    simulate.add_parser(sub)
    sweep.add_parser(sub)
    family.add_parser(sub)
    coordinator.add_parser(sub)
    agent.add_parser(sub)
    analyze.add_parser(sub)
    engine.add_parser(sub)
    model.add_parser(sub)
    profile.add_parser(sub)
    run.add_parser(sub)
    trainer.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
