"""``pearl family SCENARIO [SCENARIO ...]``: the policies over a family of scenario variants.

The family is ``pearl.sim.family``'s: one axis at a time around each base scenario
(``canonical``), or, with ``--draw N``, ``N`` variants with every axis drawn at random
from ``--draw-seed`` (scenarios pearl has never been run on). ``--only`` keeps the
variants whose names contain one of its words. Every variant is validated before anything
runs; the runs are ``pearl sweep``'s (every policy, each seed, in parallel over ``--jobs``
processes, no logs). Written to ``OUT`` (``runs/family``): ``family.json`` (every
variant's comparison, its fields, pearl's ratio to each baseline, the worst of each),
``family.md`` (the table) and ``family.png`` (with the ``analysis`` extra).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from pearl.cli.flags import integer
from pearl.cli.sweep import add_run_flags, policies_of, run_points, variant_of, write_result
from pearl.core.limits import MAX_SWEEP_POINTS
from pearl.core.profile import RuntimeProfile
from pearl.io.documents import InputError, read_document
from pearl.io.scenarios import scenario_of_document
from pearl.sim.family import BaseScenario, Variant, canonical, drawn
from pearl.sim.scenario import Scenario
from pearl.sim.sweep import Point, worst


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("family", help="run the policies over a family of scenario variants")
    p.add_argument("scenarios", nargs="+", help="base scenario files (benchmarks/scenarios/)")
    p.add_argument(
        "--draw",
        type=integer(1, MAX_SWEEP_POINTS),
        default=None,
        metavar="N",
        help="N variants drawn at random instead of the canonical family",
    )
    p.add_argument("--draw-seed", type=integer(0, 2**32 - 1), default=0, help="seed of --draw")
    p.add_argument(
        "--only", default=None, help="comma-separated words: keep variants whose names hold one"
    )
    add_run_flags(p, "variant", "runs/family")
    p.set_defaults(run=run)


def base_of(scenario: Scenario) -> BaseScenario:
    return BaseScenario(
        name=scenario.name,
        rollout_gpus=scenario.cluster.rollout.gpus,
        trainer_gpu_type=scenario.cluster.trainer.gpu_type,
        elastic_gpu_type=scenario.policy.elastic.gpu_type,
    )


def elastic_cap_gpus(scenario: Scenario) -> float:
    """The most elastic GPUs the scenario's source opens at once (inf: no cap)."""
    el = scenario.elastic
    section = el.trace or el.synthetic
    if section is None:
        return 0.0
    return float(section.max_gpus) if section.max_gpus is not None else float("inf")


def family_variants(
    paths: list[Path], draw: int | None, draw_seed: int, only: str | None
) -> list[tuple[Variant, Path, dict[str, Any]]]:
    """The family's variants, each with its base file and document (bases by name)."""
    docs: dict[str, tuple[Path, dict[str, Any]]] = {}
    bases: dict[str, BaseScenario] = {}
    for path in paths:
        doc = read_document(path)
        if not isinstance(doc, dict):
            raise InputError(path, "", "not a mapping")
        scenario, _ = scenario_of_document(doc, path)
        if scenario.name in bases:
            raise InputError(path, "name", f"{scenario.name!r}: two base scenarios of one name")
        bases[scenario.name] = base_of(scenario)
        docs[scenario.name] = (path, doc)
    if draw is None:
        family = canonical(bases)
    else:
        family = drawn(bases, np.random.default_rng(draw_seed), draw)
    if only is not None:
        words = [w.strip() for w in only.split(",") if w.strip()]
        family = [v for v in family if any(w in v.name for w in words)]
        if not family:
            raise InputError("<command line>", "--only", f"{only!r}: no variant's name holds it")
    return [(v, *docs[v.base]) for v in family]


def validated(
    family: list[tuple[Variant, Path, dict[str, Any]]], duration_s: float | None
) -> list[tuple[Point, Scenario, RuntimeProfile]]:
    """Each variant's scenario and profile; a bad one is one line naming the base file,
    the field, the problem and the variant."""
    out: list[tuple[Point, Scenario, RuntimeProfile]] = []
    for variant, path, doc in family:
        where = f"variant {variant.name}"
        scenario, profile = variant_of(doc, path, variant.point, duration_s, where, variant.name)
        point: Point = (("variant", variant.name),)
        out.append((point, scenario, profile))
    return out


def run(args: argparse.Namespace) -> int:
    policies = policies_of(args.policies)
    paths = [Path(p) for p in args.scenarios]
    family = family_variants(paths, args.draw, args.draw_seed, args.only)
    points = validated(family, args.duration_s)
    jobs = args.jobs or os.cpu_count() or 1
    started = time.monotonic()
    rows = run_points(points, policies, args.seeds, jobs)
    for row, (variant, _, _), (_, scenario, _) in zip(rows, family, points, strict=True):
        row["fields"] = {field: value for field, value in variant.point}
        row["elastic_over_base_rollout"] = elastic_cap_gpus(scenario) / max(
            scenario.cluster.rollout.gpus, 1
        )
    worst_ratio = worst([(tuple(r["point"].items()), r["ratios"]) for r in rows])
    result = {
        "scenario": "family" if args.draw is None else f"family-drawn-{args.draw_seed}",
        "bases": [str(p) for p in paths],
        "axes": {"variant": [v.name for v, _, _ in family]},
        "points": rows,
        "worst_ratio": {
            name: {"ratio": ratio, "point": dict(point)}
            for name, (ratio, point) in worst_ratio.items()
        },
        "wall_s": time.monotonic() - started,
        "jobs": jobs,
    }
    write_result(result, args.out or Path("runs") / "family", "family", args.json)
    return 0
