"""``pearl sweep SCENARIO --vary FIELD=V1,V2,...``: the policies over a grid of variants.

Each ``--vary`` is one axis (a dotted field of the scenario document and its values,
parsed as YAML scalars); several make their product (``pearl.sim.sweep``). Every point is
validated before anything runs. Each (point, seed) runs every policy, in parallel over
``--jobs`` processes (the machine's cores by default), without logs. Written to ``OUT``:
``sweep.json`` (every point's comparison, as ``pearl simulate`` reports it, and pearl's
ratio to each baseline), ``sweep.md`` (the table, and pearl's worst ratio to each
baseline over the grid) and ``sweep.png`` (each policy's throughput and pearl's ratios
across the grid; it needs the ``analysis`` extra, and is left out, said so, without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from pearl.cli.flags import integer, positive_seconds
from pearl.cli.simulate import finite_json, run_seed
from pearl.core.limits import MAX_SEEDS
from pearl.core.profile import RuntimeProfile
from pearl.io.documents import InputError, read_document
from pearl.io.extras import require
from pearl.io.scenarios import scenario_of_document
from pearl.io.untrusted import UntrustedInput, loads_yaml
from pearl.sim.baselines import REPORTED
from pearl.sim.metrics import RunMetrics
from pearl.sim.oracle import OracleBound
from pearl.sim.report import compare, runs_needed
from pearl.sim.scenario import Scenario
from pearl.sim.sweep import Axis, Point, SweepError, grid, label, ratios, with_point, worst

MAX_VALUE_BYTES = 1_000  # one value of --vary


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sweep", help="run the policies over a grid of scenario variants")
    p.add_argument("scenario", help="scenario file (benchmarks/scenarios/*.yaml)")
    p.add_argument(
        "--vary",
        action="append",
        required=True,
        metavar="FIELD=V1,V2,...",
        help="a dotted field of the scenario and its values (repeat for a product)",
    )
    add_run_flags(p, "point", "runs/sweep-SCENARIO")
    p.set_defaults(run=run)


def add_run_flags(p: argparse.ArgumentParser, unit: str, default_out: str) -> None:
    """The flags ``pearl sweep`` and ``pearl family`` share: which policies, how many seeds
    per ``unit``, the simulated time, the processes, the output folder and ``--json``."""
    p.add_argument(
        "--policies", default=",".join(REPORTED), help=f"comma-separated, from {','.join(REPORTED)}"
    )
    p.add_argument("--seeds", type=integer(1, MAX_SEEDS), default=None, help=f"runs per {unit}")
    p.add_argument(
        "--duration-s", type=positive_seconds, default=None, help="override the simulated time"
    )
    p.add_argument(
        "--jobs", type=integer(1, 1024), default=None, help="processes (default: the cores)"
    )
    p.add_argument("--out", type=Path, default=None, help=f"output folder ({default_out})")
    p.add_argument("--json", action="store_true", help="print only the JSON result")


def axis_of(text: str) -> Axis:
    """``FIELD=V1,V2,...`` as an axis; each value a YAML scalar (``4``, ``0.5``, ``colocated``)."""
    field, sep, values = text.partition("=")
    if not sep or not field or not values:
        raise InputError("<command line>", "--vary", f"{text!r}: expected FIELD=V1,V2,...")
    parsed = []
    for raw in values.split(","):
        try:
            value = loads_yaml(raw, max_bytes=MAX_VALUE_BYTES)
        except UntrustedInput as err:
            raise InputError("<command line>", f"--vary {field}", f"{raw!r}: {err}") from None
        if isinstance(value, dict | list) or value is None:
            raise InputError("<command line>", f"--vary {field}", f"{raw!r}: not a single value")
        parsed.append(value)
    return Axis(field, tuple(parsed))


def variants(
    path: Path, axes: list[Axis], duration_s: float | None
) -> list[tuple[Point, Scenario, RuntimeProfile]]:
    """Every point of the grid with its validated scenario and the profile it names (a
    point may vary ``profile``): a bad one is one line naming the scenario file, the
    field, the problem and the point."""
    doc = read_document(path)
    if not isinstance(doc, dict):
        raise InputError(path, "", "not a mapping")
    try:
        points = grid(axes)
    except SweepError as err:
        raise InputError("<command line>", f"--vary {err.field}", err.problem) from None
    return [
        (point, *variant_of(doc, path, point, duration_s, f"at {label(point)}")) for point in points
    ]


def variant_of(
    doc: dict[str, Any],
    path: Path,
    point: Point,
    duration_s: float | None,
    where: str,
    name: str | None = None,
) -> tuple[Scenario, RuntimeProfile]:
    """The scenario document with the point's values set, validated, with the profile it
    names (and ``name`` and ``duration_s`` when given); a bad one is one line naming the
    scenario file, the field, the problem and ``where`` the point is."""
    try:
        scenario, profile = scenario_of_document(with_point(doc, point), path)
    except (SweepError, InputError) as err:
        raise InputError(path, err.field, f"{err.problem} ({where})") from None
    if name is not None:
        scenario = scenario.model_copy(update={"name": name})
    if duration_s is not None:
        scenario = scenario.model_copy(update={"duration_s": duration_s})
    return scenario, profile


def run(args: argparse.Namespace) -> int:
    policies = policies_of(args.policies)
    path = Path(args.scenario)
    axes = [axis_of(text) for text in args.vary]
    points = variants(path, axes, args.duration_s)
    jobs = args.jobs or os.cpu_count() or 1
    out = args.out or Path("runs") / f"sweep-{points[0][1].name}"
    started = time.monotonic()
    rows = run_points(points, policies, args.seeds, jobs)
    result = _result(path, axes, rows, time.monotonic() - started, jobs)
    write_result(result, out, "sweep", args.json)
    return 0


def policies_of(text: str) -> list[str]:
    """``--policies``: names of ``REPORTED``, pearl among them."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in REPORTED]
    if unknown or "pearl" not in policies:
        raise InputError(
            "<command line>", "--policies", f"unknown {unknown} or no pearl; known: {REPORTED}"
        )
    return policies


def run_points(
    points: list[tuple[Point, Scenario, RuntimeProfile]],
    policies: list[str],
    seeds: int | None,
    jobs: int,
) -> list[dict[str, Any]]:
    """Every policy on every point and seed (``seeds``, or each scenario's own), in
    parallel over ``jobs`` processes: one row per point, its comparison (as ``pearl
    simulate`` reports it) and pearl's ratio to each baseline."""
    names = runs_needed(policies)
    tasks = [(i, seed) for i, (_, sc, _) in enumerate(points) for seed in range(seeds or sc.seeds)]
    results: dict[tuple[int, int], tuple[dict[str, RunMetrics], OracleBound]] = {}
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(run_seed, points[i][1], points[i][2], seed, names): (i, seed)
            for i, seed in tasks
        }
        for done, future in enumerate(as_completed(futures), 1):
            i, seed = futures[future]
            results[(i, seed)] = future.result()
            elapsed_s = time.monotonic() - started
            sys.stderr.write(
                f"[{done}/{len(tasks)}] {label(points[i][0])} seed {seed}: {elapsed_s:.0f} s\n"
            )
    rows = []
    for i, (point, scenario, _) in enumerate(points):
        done_seeds = sorted(s for j, s in results if j == i)
        runs = {n: [results[(i, s)][0][n] for s in done_seeds] for n in names}
        oracle = [results[(i, s)][1] for s in done_seeds]
        comparison = compare(policies, runs, oracle, scenario.duration_s)
        tph = {n: e["throughput_traj_per_h"] for n, e in comparison.items()}
        rows.append({"point": dict(point), "policies": comparison, "ratios": ratios(tph)})
    return rows


def write_result(result: dict[str, Any], out: Path, stem: str, as_json: bool) -> None:
    """``STEM.json``, ``STEM.md`` and ``STEM.png`` in ``out``; the table (or the JSON) on
    stdout."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite_json(result), indent=2, allow_nan=False)
    (out / f"{stem}.json").write_text(text + "\n", encoding="utf-8")
    table = markdown(result)
    (out / f"{stem}.md").write_text(table, encoding="utf-8")
    plotted = _plot(result, out / f"{stem}.png", f"{stem}.png")
    if as_json:
        print(json.dumps(finite_json(result), allow_nan=False))
    else:
        print(table, end="")
        print(f"{stem}.json, {stem}.md{f', {stem}.png' if plotted else ''} in {out}")


def _result(
    path: Path, axes: list[Axis], rows: list[dict[str, Any]], wall_s: float, jobs: int
) -> dict[str, Any]:
    points = [(tuple(r["point"].items()), r["ratios"]) for r in rows]
    return {
        "scenario": str(path),
        "axes": {a.field: list(a.values) for a in axes},
        "points": rows,
        "worst_ratio": {
            name: {"ratio": ratio, "point": dict(point)}
            for name, (ratio, point) in worst(points).items()
        },
        "wall_s": wall_s,
        "jobs": jobs,
    }


def markdown(result: dict[str, Any]) -> str:
    """The table: one row per point, each policy's traj/h, pearl's ratio to each baseline
    and its share of the oracle; then pearl's worst ratio to each baseline."""
    rows = result["points"]
    fields = list(result["axes"])
    policies = [n for n in rows[0]["policies"] if n != "oracle"]
    baselines = list(rows[0]["ratios"])
    head = [*fields, *(f"{n} traj/h" for n in policies), *(f"pearl / {b}" for b in baselines)]
    head.append("pearl of oracle")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["point"][f]) for f in fields]
        cells += [f"{r['policies'][n]['throughput_traj_per_h']:,.0f}" for n in policies]
        cells += [f"{r['ratios'][b]:.3f}" for b in baselines]
        cells.append(f"{r['policies']['pearl']['oracle_fraction']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, w in result["worst_ratio"].items():
        lines.append(
            f"pearl / {name}: worst {w['ratio']:.3f} at {label(tuple(w['point'].items()))}"
        )
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], path: Path, what: str) -> bool:
    try:
        require("matplotlib")
    except InputError as err:
        sys.stderr.write(f"{what} left out: {err}\n")
        return False
    from pearl.analysis.sweep_plots import sweep_figure

    sweep_figure(result, path)
    return True
