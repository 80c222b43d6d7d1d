"""``pearl bench ...``: benchmarks that print JSON (targets live in the docs, not in tests)."""

from __future__ import annotations

import argparse
import json
from typing import get_args

from pearl.bench.decide import bench_decide
from pearl.bench.simulator import bench_predictor, bench_sim
from pearl.cli.flags import gpus, integer, number, positive_seconds, repeats, seconds
from pearl.core.limits import MAX_SECONDS, MAX_SEEDS, MAX_TOKENS, MAX_TRAJECTORIES
from pearl.io.documents import InputError
from pearl.io.extras import require
from pearl.sim.engine_models import EngineModelName


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures")
    which = p.add_subparsers(dest="bench", required=True)
    d = which.add_parser("decide", help="time full decide() calls on a realistic state")
    d.add_argument("--gpus", type=gpus, default=1024, help="GPUs in the state (8 per node)")
    d.add_argument("--repeats", type=repeats, default=30, help="timed decide() calls")
    d.add_argument("--profile", default="qwen3-8b", help="shipped profile name or path")
    d.add_argument("--json", action="store_true", help="print only the JSON object")
    d.set_defaults(run=_run_decide)
    pr = which.add_parser("predictor", help="predictor error against simulated batch times")
    pr.add_argument("scenario", help="scenario file (benchmarks/scenarios/*.yaml)")
    pr.add_argument("--seeds", type=integer(1, MAX_SEEDS), default=1, help="pearl runs to pool")
    pr.add_argument(
        "--duration-s", type=positive_seconds, default=None, help="override the simulated time"
    )
    pr.add_argument("--json", action="store_true", help="print only the JSON object")
    pr.set_defaults(run=_run_predictor)
    sm = which.add_parser("sim", help="simulation speed at scale")
    sm.add_argument("--gpus", type=gpus, default=256, help="GPUs: base and elastic together")
    sm.add_argument(
        "--sim-hours",
        type=number(0.0, MAX_SECONDS / 3600, low_open=True),
        default=24.0,
        help="simulated hours",
    )
    sm.add_argument(
        "--engine-model",
        choices=get_args(EngineModelName),
        default="fluid",
        help="engine model (fluid: within 2%% of step's throughput, faster)",
    )
    sm.add_argument("--json", action="store_true", help="print only the JSON object")
    sm.set_defaults(run=_run_sim)
    ct = which.add_parser("control", help="plan round trip over the MPI control plane")
    ct.add_argument(
        "--agents", type=integer(1, 1_024), default=16, help="agents started on this machine"
    )
    ct.add_argument("--repeats", type=repeats, default=100, help="timed 64-step plans")
    ct.add_argument("--json", action="store_true", help="print only the JSON object")
    ct.set_defaults(run=_run_control)
    an = which.add_parser("analyze", help="pearl analyze on a synthetic run log")
    an.add_argument(
        "--events", type=integer(1, 100_000_000), default=1_000_000, help="records in the log"
    )
    an.add_argument("--json", action="store_true", help="print only the JSON object")
    an.set_defaults(run=_run_analyze)
    en = which.add_parser("engine", help="reference engine against naive generate(), and PD")
    en.add_argument("--model", default=None, help="model directory (default: a tiny one)")
    en.add_argument("--concurrency", default="1,8,32", help="concurrent requests, comma list")
    en.add_argument(
        "--max-tokens", type=integer(1, MAX_TOKENS), default=64, help="tokens generated per request"
    )
    en.add_argument(
        "--prompt-tokens",
        type=integer(1, MAX_TOKENS),
        default=512,
        help="prompt of the prefill runs",
    )
    en.add_argument(
        "--threads", type=integer(1, 1_024), default=None, help="torch threads (engine, naive)"
    )
    en.add_argument(
        "--pd-requests", type=repeats, default=8, help="requests through prefill->decode"
    )
    en.add_argument(
        "--settle-s", type=seconds, default=0.5, help="pause between engine and naive phases"
    )
    en.add_argument("--json", action="store_true", help="print only the JSON object")
    en.set_defaults(run=_run_engine)
    ro = which.add_parser("router", help="router overhead per turn, and a P:D change under load")
    ro.add_argument("--turns", type=repeats, default=200, help="turns timed each way")
    ro.add_argument(
        "--trajectories",
        type=integer(1, MAX_TRAJECTORIES),
        default=8,
        help="load during the P:D change",
    )
    ro.add_argument("--phase-s", type=positive_seconds, default=3.0, help="seconds of each phase")
    ro.add_argument("--json", action="store_true", help="print only the JSON object")
    ro.set_defaults(run=_run_router)


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
    return _print(bench_sim(args.gpus, args.sim_hours, args.engine_model), args.json)


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


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"1,8,32"`` as ``(1, 8, 32)``; anything else (or a value < 1) is an input error."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise InputError(
            "<command line>", flag, f"need positive integers, comma separated: {text!r}"
        )
    return values


def _run_engine(args: argparse.Namespace) -> int:
    concurrency = int_list(args.concurrency, "--concurrency")
    if args.max_tokens < 1 or args.prompt_tokens < 1 or args.pd_requests < 1:
        raise InputError(
            "<command line>", "--max-tokens/--prompt-tokens/--pd-requests", "need >= 1"
        )
    if args.threads is not None and args.threads < 1:
        raise InputError("<command line>", "--threads", "need >= 1")
    for module in ("torch", "fastapi", "uvicorn", "prometheus_client"):
        require(module)
    require("transformers")
    from pearl.bench.engine import bench_engine

    result = bench_engine(
        args.model,
        concurrency,
        args.max_tokens,
        args.prompt_tokens,
        args.threads,
        args.pd_requests,
        max(0.0, args.settle_s),
    )
    return _print(result, args.json)


def _run_router(args: argparse.Namespace) -> int:
    if args.turns < 10 or args.trajectories < 1 or args.phase_s <= 0:
        raise InputError(
            "<command line>", "--turns/--trajectories/--phase-s", "need >= 10, >= 1 and > 0"
        )
    for module in ("torch", "fastapi", "uvicorn"):
        require(module)
    from pearl.bench.router import bench_router

    return _print(bench_router(args.turns, 4, args.trajectories, args.phase_s), args.json)
