"""``pearl bench ...``: benchmarks that print JSON (targets live in the docs, not in tests)."""

from __future__ import annotations

import argparse
import json

from pearl.bench.decide import bench_decide
from pearl.io.documents import InputError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures")
    which = p.add_subparsers(dest="bench", required=True)
    d = which.add_parser("decide", help="time full decide() calls on a realistic state")
    d.add_argument("--gpus", type=int, default=1024, help="GPUs in the state (8 per node)")
    d.add_argument("--repeats", type=int, default=30, help="timed decide() calls")
    d.add_argument("--profile", default="qwen3-8b", help="shipped profile name or path")
    d.add_argument("--json", action="store_true", help="print only the JSON object")
    d.set_defaults(run=_run_decide)


def _run_decide(args: argparse.Namespace) -> int:
    if args.gpus < 24 or args.repeats < 1:
        raise InputError("<command line>", "--gpus/--repeats", "need --gpus >= 24, --repeats >= 1")
    result = bench_decide(args.gpus, args.repeats, args.profile)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
