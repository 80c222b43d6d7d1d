"""``pearl bench ...``: benchmarks that print JSON (targets live in the docs, not in tests)."""

from __future__ import annotations

import argparse
import json

from pearl.bench.decide import bench_decide
from pearl.bench.simulator import bench_predictor, bench_sim
from pearl.io.documents import InputError
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures")
    which = p.add_subparsers(dest="bench", required=True)
    d = which.add_parser("decide", help="time full decide() calls on a realistic state")
    d.add_argument("--gpus", type=int, default=1024, help="GPUs in the state (8 per node)")
    d.add_argument("--repeats", type=int, default=30, help="timed decide() calls")
    d.add_argument("--profile", default="qwen3-8b", help="shipped profile name or path")
    d.add_argument("--json", action="store_true", help="print only the JSON object")
    d.set_defaults(run=_run_decide)
    pr = which.add_parser("predictor", help="predictor error against simulated batch times")
    pr.add_argument("scenario", help="scenario file (benchmarks/scenarios/*.yaml)")
    pr.add_argument("--seeds", type=int, default=1, help="pearl runs to pool")
    pr.add_argument("--duration-s", type=float, default=None, help="override the simulated time")
    pr.add_argument("--json", action="store_true", help="print only the JSON object")
    pr.set_defaults(run=_run_predictor)
    sm = which.add_parser("sim", help="simulation speed at scale")
    sm.add_argument("--gpus", type=int, default=256, help="GPUs: base and elastic together")
    sm.add_argument("--sim-hours", type=float, default=24.0, help="simulated hours")
    sm.add_argument("--json", action="store_true", help="print only the JSON object")
    sm.set_defaults(run=_run_sim)
    ct = which.add_parser("control", help="plan round trip over the MPI control plane")
    ct.add_argument("--agents", type=int, default=16, help="agents started on this machine")
    ct.add_argument("--repeats", type=int, default=100, help="timed 64-step plans")
    ct.add_argument("--json", action="store_true", help="print only the JSON object")
    ct.set_defaults(run=_run_control)
    an = which.add_parser("analyze", help="pearl analyze on a synthetic run log")
    an.add_argument("--events", type=int, default=1_000_000, help="records in the log")
    an.add_argument("--json", action="store_true", help="print only the JSON object")
    an.set_defaults(run=_run_analyze)


def _run_decide(args: argparse.Namespace) -> int:
    if args.gpus < 24 or args.repeats < 1:
        raise InputError("<command line>", "--gpus/--repeats", "need --gpus >= 24, --repeats >= 1")
    result = bench_decide(args.gpus, args.repeats, args.profile)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


def _print(result: dict[str, object], as_json: bool) -> int:
    print(json.dumps(result) if as_json else json.dumps(result, indent=2))
    return 0


def _run_predictor(args: argparse.Namespace) -> int:
    if args.seeds < 1 or (args.duration_s is not None and args.duration_s <= 0):
        raise InputError("<command line>", "--seeds/--duration-s", "need >= 1 and > 0")
    return _print(bench_predictor(args.scenario, args.seeds, args.duration_s), args.json)


def _run_sim(args: argparse.Namespace) -> int:
    if args.gpus < 32 or args.sim_hours <= 0:
        raise InputError("<command line>", "--gpus/--sim-hours", "need --gpus >= 32, hours > 0")
    return _print(bench_sim(args.gpus, args.sim_hours), args.json)


def _run_control(args: argparse.Namespace) -> int:
    if args.agents < 1 or args.repeats < 1:
        raise InputError("<command line>", "--agents/--repeats", "need >= 1")
    require("mpi4py")
    from pearl.bench.control_latency import main  # initialises MPI in this process

    argv = ["--agents", str(args.agents), "--repeats", str(args.repeats)]
    return main([*argv, "--json"] if args.json else argv)  # exits the process (no Finalize)


def _run_analyze(args: argparse.Namespace) -> int:
    if args.events < 100:
        raise InputError("<command line>", "--events", "need >= 100")
    require("matplotlib")  # before writing the log: the report draws its plots
    from pearl.analysis.bench import bench_analyze

    return _print(bench_analyze(args.events), args.json)
