"""``pearl simulate SCENARIO``: every policy on a scenario, a table, logs and a summary.

Each (policy, seed) run writes its JSONL log to ``OUT/POLICY/seedN.jsonl`` (schema in
``docs/log-schema.md``); ``OUT/summary.json`` holds the comparison, every run's metrics
and, when pearl ran, its predictor's error over its runs' decisions (``predictor``, the
figures of ``pearl bench predictor`` on the same runs). The runs go in parallel over
``--jobs`` processes (the machine's cores by default; each run is seeded, so the figures
are the same whatever the processes). With ``--json`` stdout carries one JSON object (the
comparison and the predictor's error) and nothing else; the progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from functools import partial
from pathlib import Path
from typing import Any

from pearl.cli.flags import integer, positive_seconds
from pearl.core.limits import MAX_SEEDS
from pearl.core.profile import RuntimeProfile
from pearl.io.documents import InputError
from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.runlog.jsonl import RunLogWriter
from pearl.sim.baselines import REPORTED, make_policy
from pearl.sim.metrics import RunMetrics
from pearl.sim.oracle import OracleBound, run_oracle_bound
from pearl.sim.predictions import prediction_errors
from pearl.sim.report import compare, runs_needed, table
from pearl.sim.runner import simulate
from pearl.sim.scenario import Scenario


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="compare pearl with the baselines on a scenario")
    p.add_argument("scenario", help="scenario file (benchmarks/scenarios/*.yaml)")
    p.add_argument(
        "--policies", default=",".join(REPORTED), help=f"comma-separated, from {','.join(REPORTED)}"
    )
    p.add_argument(
        "--seeds",
        type=integer(1, MAX_SEEDS),
        default=None,
        help="runs per policy (scenario default)",
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (runs/SCENARIO)")
    p.add_argument(
        "--duration-s", type=positive_seconds, default=None, help="override the simulated time"
    )
    p.add_argument(
        "--jobs", type=integer(1, 1024), default=None, help="processes (default: the cores)"
    )
    p.add_argument("--json", action="store_true", help="print only the JSON comparison")
    p.set_defaults(run=run)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total_runs: int) -> None:
        self.total, self.done, self.started = total_runs, 0, time.monotonic()
        self.drawn_s = -1.0

    def show(self, label: str, fraction: float) -> None:
        now_s = time.monotonic()
        if now_s - self.drawn_s < 0.25 and fraction < 1.0:
            return
        self.drawn_s = now_s
        overall = (self.done + fraction) / self.total
        bar = "#" * int(30 * overall)
        elapsed_s = now_s - self.started
        sys.stderr.write(f"\r[{bar:<30}] {100 * overall:5.1f}%  {label:<32} {elapsed_s:6.0f} s")
        sys.stderr.flush()

    def finish_run(self) -> None:
        self.done += 1
        if self.done == self.total:
            sys.stderr.write("\n")


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in REPORTED]
    if unknown or not policies:
        raise InputError("<command line>", "--policies", f"unknown {unknown}; known: {REPORTED}")
    scenario, profile = load_scenario_and_profile(args.scenario)
    if args.duration_s is not None:
        if args.duration_s <= 0:
            raise InputError("<command line>", "--duration-s", "must be > 0")
        scenario = scenario.model_copy(update={"duration_s": args.duration_s})
    seeds = args.seeds if args.seeds is not None else scenario.seeds
    if seeds < 1:
        raise InputError("<command line>", "--seeds", "must be >= 1")
    out = args.out or Path("runs") / scenario.name
    names = runs_needed(policies)
    jobs = args.jobs or os.cpu_count() or 1
    progress = Progress(len(names) * seeds)
    runs, oracle = run_all(scenario, profile, names, seeds, out, progress, jobs)
    comparison = compare(policies, runs, oracle, scenario.duration_s)
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "policies": comparison,
    }
    if "pearl" in runs:
        seeded = [(m.seed, p) for m in runs["pearl"] for p in m.predictions]
        result["predictor"] = prediction_errors(seeded)
    summary: dict[str, Any] = {
        **result,
        "duration_s": scenario.duration_s,
        "seeds": seeds,
        "runs": {n: [_run_entry(m) for m in ms] for n, ms in runs.items()},
        "oracle": [o.__dict__ for o in oracle],
        "jobs": jobs,
    }
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite_json(summary), indent=2, allow_nan=False)
    (out / "summary.json").write_text(text + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(finite_json(result), allow_nan=False))
    else:
        hours = scenario.duration_s / 3600
        print(f"{scenario.name}: {hours:.2f} h simulated, {seeds} seeds, mean over seeds")
        print(table(comparison))
        print(f"logs and summary.json in {out}")
    return 0


Runs = dict[str, list[RunMetrics]]  # policy -> its runs, by seed


def logged_run(
    scenario: Scenario,
    profile: RuntimeProfile,
    name: str,
    seed: int,
    log_path: Path,
    on_progress: Callable[[float], None] | None = None,
) -> RunMetrics:
    """One policy's run of one seed, its log written to ``log_path``."""
    policy = make_policy(name, scenario.policy, scenario.cluster.trainer.nodes)
    inputs = run_inputs(scenario, profile, seed)
    with RunLogWriter(log_path, truncate=True) as log:
        return simulate(inputs, policy, log.write, on_progress)


def oracle_bound(scenario: Scenario, profile: RuntimeProfile, seed: int) -> OracleBound:
    return run_oracle_bound(run_inputs(scenario, profile, seed))


def run_all(
    scenario: Scenario,
    profile: RuntimeProfile,
    names: Sequence[str],
    seeds: int,
    out: Path,
    progress: Progress,
    jobs: int,
) -> tuple[Runs, list[OracleBound]]:
    """Every (policy, seed) run and each seed's oracle bound: with one job in this process,
    the bar moving within each run; else each a task of a pool of ``jobs`` processes, the
    bar moving as runs end."""
    if jobs == 1:
        runs: Runs = {n: [] for n in names}
        oracle: list[OracleBound] = []
        for seed in range(seeds):
            oracle.append(oracle_bound(scenario, profile, seed))
            for name in names:
                show = partial(progress.show, f"{name} seed {seed}")
                log_path = out / name / f"seed{seed}.jsonl"
                runs[name].append(logged_run(scenario, profile, name, seed, log_path, show))
                progress.finish_run()
        return runs, oracle
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        bounds = [pool.submit(oracle_bound, scenario, profile, seed) for seed in range(seeds)]
        tasks: dict[Future[RunMetrics], tuple[str, int]] = {}
        for seed in range(seeds):  # seed by seed: the first seed's runs end first
            for name in names:
                log_path = out / name / f"seed{seed}.jsonl"
                future = pool.submit(logged_run, scenario, profile, name, seed, log_path)
                tasks[future] = (name, seed)
        done: dict[tuple[str, int], RunMetrics] = {}
        try:
            for future in as_completed(tasks):
                name, seed = tasks[future]
                done[(name, seed)] = future.result()
                progress.show(f"{name} seed {seed}", 0.0)
                progress.finish_run()
            oracle = [b.result() for b in bounds]
        except BaseException:  # a run failed (or ^C): cancel the runs not yet started
            pool.shutdown(cancel_futures=True)
            raise
    runs = {n: [done[(n, seed)] for seed in range(seeds)] for n in names}
    return runs, oracle


def run_seed(
    scenario: Scenario, profile: RuntimeProfile, seed: int, names: Sequence[str]
) -> tuple[dict[str, RunMetrics], OracleBound]:
    """Every named policy's run of one seed, without logs (``pearl sweep``'s task), and the
    oracle's bound on that seed's trajectories."""
    inputs = run_inputs(scenario, profile, seed)
    nodes = scenario.cluster.trainer.nodes
    runs = {name: simulate(inputs, make_policy(name, scenario.policy, nodes)) for name in names}
    return runs, run_oracle_bound(inputs)


def _run_entry(m: RunMetrics) -> dict[str, Any]:
    entry = m.summary()
    entry.update(
        seed=m.seed,
        trajectories=m.trajectories,
        unfinished=m.unfinished,
        decisions=m.decisions,
        events=m.num_events,
    )
    return entry


def finite_json(value: Any) -> Any:
    """JSON has no NaN: a figure with no data (no batch completed) is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
