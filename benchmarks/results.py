"""Write docs/results.md: every shipped scenario with every policy, 3 seeds, and the
predictor's error on the same runs' decisions.

    .venv/bin/python benchmarks/results.py   # 150 min on 2 cores at ff02a4c (serial scenarios)
    .venv/bin/python benchmarks/results.py --notes-only   # the commentary alone
    .venv/bin/python benchmarks/results.py --dev-cluster PAIR_DIR   # pearl run on Slurm


For each scenario it runs ``pearl simulate SCENARIO --json`` (on the machine's cores;
timing it: the issue's budget is 3 minutes per scenario on one core, held against the
runs' CPU time) and takes the predictor's error from its pearl runs (``predictor``: the
figures of ``pearl bench predictor SCENARIO --seeds 3``, which would run them again), then
writes the tables, the ratios the issue expects and whether each holds. Nothing in the
file is typed by hand except the text in ``NOTES`` below.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import dev_cluster_results
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("qwen3-8b", "qwen3-30b-a3b")
# The paper's regime (issue 18): throughput-bound base rollout, large elastic and lendable
# supply; each with pearl's expected lead over rlboost-plus there (1.27x, 1.36x for the MoE).
PAPER_SCENARIOS = {"qwen3-8b-paper": 1.27, "qwen3-30b-a3b-paper": 1.36}
PEARL = [sys.executable, "-m", "pearl.cli.main"]

NOTES = ROOT / "benchmarks" / "results_notes.md"


class Timed(NamedTuple):
    result: dict[str, Any]
    wall_s: float
    cpu_s: float  # of the command and every process it waited for


def run_json(args: list[str]) -> Timed:
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([*PEARL, *args], cwd=ROOT, check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Timed(json.loads(out.stdout), time.perf_counter() - start, cpu_s)


def jobs_of(out: Path) -> int:
    """The processes a ``pearl simulate --out OUT`` ran on (its summary's ``jobs``)."""
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    return int(summary["jobs"])


def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def scenario_section(name: str, rlboost_lead: float = 1.27, in_order: bool = True) -> list[str]:
    path = f"benchmarks/scenarios/{name}.yaml"
    out = ROOT / "runs" / "results" / name
    sim = run_json(["simulate", path, "--json", "--out", str(out)])
    pol, pred = sim.result["policies"], sim.result["predictor"]
    jobs = jobs_of(out)
    lines = [
        f"## {name}",
        "",
        f"`pearl simulate {path}` (3 seeds): {sim.wall_s:.0f} s wall on {jobs} processes, "
        f"{sim.cpu_s:.0f} s of CPU (budget 180 s on one core: "
        f"{'met' if sim.cpu_s <= 180 else 'missed'}).",
        "",
    ]
    lines += [
        "| policy | traj/h | tokens/s | steps/h | traj/GPU-h | GPU-h base | borrowed | elastic "
        "| batch s mean | batch s p99 | transitions | max trainer wait s | off-policy share "
        "| wasted Mtok | restarted | of oracle |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, e in pol.items():
        if p == "oracle":
            lines.append(
                f"| oracle | {fmt(e['throughput_traj_per_h'])} | | | | | | | | | | | | | | 1.000 |"
            )
            continue
        g, b, r = e["gpu_hours"], e["batch_time_s"], e["rollout"]
        lines.append(
            f"| {p} | {fmt(e['throughput_traj_per_h'])} | {fmt(e['tokens_per_s'])} "
            f"| {fmt(e['train_steps_per_h'], '.1f')} | {fmt(e['traj_per_gpu_hour'], '.1f')} "
            f"| {fmt(g['base'], '.1f')} | {fmt(g['borrowed'], '.1f')} | {fmt(g['elastic'], '.1f')} "
            f"| {fmt(b['mean'], '.1f')} | {fmt(b['p99'], '.1f')} | {fmt(e['transitions'], '.1f')} "
            f"| {fmt(e['max_trainer_wait_s'], '.1f')} | {fmt(r['off_policy_share'], '.2f')} "
            f"| {fmt(r['wasted_tokens'] / 1e6, '.2f')} | {fmt(r['restarted'], '.0f')} "
            f"| {fmt(e['oracle_fraction'], '.3f')} |"
        )
    o = pol["oracle"]
    if "by_admission_traj_per_h" in o:  # first-completed batching (pearl.sim.oracle F1-F8)
        oracle_line = (
            f"Oracle (first-completed): at most {o['max_updates']:.1f} updates by the end "
            f"(mean over seeds); at the update count that binds, admission "
            f"{fmt(o['by_admission_traj_per_h'])}, critical path "
            f"{fmt(o['by_critical_path_traj_per_h'])}, capacity "
            f"{fmt(o['by_capacity_traj_per_h'])}, in flight {fmt(o['by_in_flight_traj_per_h'])}"
            f", capacity and in flight together {fmt(o['by_blend_traj_per_h'])} traj/h (the "
            "smallest is the oracle)."
        )
    else:
        oracle_line = (
            f"Oracle: critical-path bound {fmt(o['by_critical_path_traj_per_h'])} traj/h, "
            f"capacity bound {fmt(o['by_capacity_traj_per_h'])} traj/h (the smaller is the "
            "oracle)."
        )
    lines += ["", oracle_line, ""]
    tp = {p: e["throughput_traj_per_h"] for p, e in pol.items()}
    best_baseline = max(v for p, v in tp.items() if p not in ("pearl", "oracle"))
    checks = [
        (
            "pearl beats every baseline on throughput",
            tp["pearl"] > best_baseline,
            f"pearl {fmt(tp['pearl'])} vs best baseline {fmt(best_baseline)} traj/h",
        ),
        (
            "pearl >= 2.17x roll-fixed",
            tp["pearl"] >= 2.17 * tp["roll-fixed"],
            f"{tp['pearl'] / tp['roll-fixed']:.3f}x",
        ),
        (
            f"pearl >= {rlboost_lead}x rlboost-plus",
            tp["pearl"] >= rlboost_lead * tp["rlboost-plus"],
            f"{tp['pearl'] / tp['rlboost-plus']:.3f}x",
        ),
        (
            "pearl within 10% of the oracle",
            pol["pearl"]["oracle_fraction"] >= 0.9,
            f"{pol['pearl']['oracle_fraction']:.3f} of the oracle",
        ),
        (
            "pearl's trainer wait <= max_return_delay_s (30 s) in every run",
            pol["pearl"]["max_trainer_wait_s"] <= 30.0,
            f"pearl's worst {fmt(pol['pearl']['max_trainer_wait_s'], '.1f')} s (baselines: see "
            "the table)",
        ),
        (
            "predictor MAPE <= 0.10",
            pred["mape"] is not None and pred["mape"] <= 0.10,
            f"MAPE {fmt(pred['mape'], '.3f')} over {pred['n']} decisions, median "
            f"{fmt(pred['median_ape'], '.3f')}, mean predicted/actual "
            f"{fmt(pred['mean_ratio_predicted_to_actual'], '.3f')}",
        ),
    ]
    lines += ["| expectation | holds | measured |", "|---|---|---|"]
    lines += [f"| {what} | {'yes' if ok else '**no**'} | {how} |" for what, ok, how in checks]
    return [*lines, "", *(in_order_section(name, tp) if in_order else [])]


def in_order_section(name: str, first_completed: dict[str, float]) -> list[str]:
    """The same scenario under the old semantics (``batching: in-order``), for comparison:
    its YAML is written beside the logs, the shipped file with that one field changed."""
    shipped = ROOT / "benchmarks" / "scenarios" / f"{name}.yaml"
    doc = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    doc["rollout"]["batching"] = "in-order"
    # (the shipped scenarios name no file by a relative path, so the copy reads the same)
    out = ROOT / "runs" / "results" / f"{name}-in-order"
    out.mkdir(parents=True, exist_ok=True)
    variant = out / f"{name}-in-order.yaml"
    variant.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    sim = run_json(["simulate", str(variant), "--json", "--out", str(out)])
    pol = sim.result["policies"]
    jobs = jobs_of(out)
    lines = [
        f"Old semantics for comparison (`rollout.batching: in-order`, the rest as shipped; "
        f"3 seeds, {sim.wall_s:.0f} s wall on {jobs} processes): batch b is trajectories "
        "b*B..(b+1)*B-1 and the trainer waits for all of them.",
        "",
        "| policy | traj/h in-order | traj/h first-completed | of in-order oracle |",
        "|---|---|---|---|",
    ]
    for p, e in pol.items():
        lines.append(
            f"| {p} | {fmt(e['throughput_traj_per_h'])} | {fmt(first_completed.get(p))} "
            f"| {fmt(e['oracle_fraction'], '.3f')} |"
        )
    tp = {p: e["throughput_traj_per_h"] for p, e in pol.items()}
    lines += [
        "",
        f"In-order: pearl {tp['pearl'] / tp['roll-fixed']:.3f}x roll-fixed, "
        f"{tp['pearl'] / tp['rlboost-plus']:.3f}x rlboost-plus.",
        "",
    ]
    return lines


FAMILY_BASES = [f"benchmarks/scenarios/{name}.yaml" for name in SCENARIOS]
FAMILY_DURATION_S = 900  # half the shipped scenarios' 30 minutes: 30 variants x 3 seeds
DRAWN = 12  # variants of the drawn family (pearl.sim.family.drawn)
DRAWN_SEED = 2026


def family_section(drawn: bool) -> list[str]:
    """The family of ``pearl family`` (canonical, or drawn at random), 3 seeds each: every
    variant's throughput per policy, pearl's ratio to each baseline (the worst over the
    family), and the issue's two expectations on it."""
    what = "drawn" if drawn else "canonical"
    out = ROOT / "runs" / "results" / f"family-{what}"
    args = ["family", *FAMILY_BASES, "--json", "--out", str(out), "--seeds", "3"]
    args += ["--duration-s", str(FAMILY_DURATION_S)]
    if drawn:
        args += ["--draw", str(DRAWN), "--draw-seed", str(DRAWN_SEED)]
    result, wall_s, _ = run_json(args)
    png = ROOT / "docs" / f"results-family-{what}.png"
    if (out / "family.png").exists():
        png.write_bytes((out / "family.png").read_bytes())
    rows = result["points"]
    baselines = list(rows[0]["ratios"])
    command = f"pearl family {' '.join(FAMILY_BASES)} --seeds 3 --duration-s {FAMILY_DURATION_S}"
    if drawn:
        command += f" --draw {DRAWN} --draw-seed {DRAWN_SEED}"
    lines = [
        f"### The {what} family",
        "",
        f"`{command}` ({len(rows)} variants, {FAMILY_DURATION_S} s simulated each, 3 seeds, "
        f"{wall_s:.0f} s wall on {result['jobs']} processes; each variant's fields are in "
        f"`runs/results/family-{what}/family.json`). Traj/h, means over the seeds.",
        "",
        "| variant | elastic / base rollout | pearl | "
        + " | ".join(baselines)
        + " | pearl / best baseline | pearl / rlboost-plus | pearl of oracle |",
        "|---|---|---|" + "---|" * len(baselines) + "---|---|---|",
    ]
    short = 0
    behind = []
    for r in rows:
        pol = r["policies"]
        tph = {n: e["throughput_traj_per_h"] for n, e in pol.items()}
        ratios = [x for x in r["ratios"].values() if x is not None]  # null: a baseline at 0
        best = min(ratios, default=float("nan"))
        factor = r["elastic_over_base_rollout"]
        vs_rlboost = r["ratios"].get("rlboost-plus")
        if factor is None or factor >= 1.0:
            short += vs_rlboost is not None and vs_rlboost < 1.25
        if not best >= 1.0:
            behind.append(r["point"]["variant"])
        lines.append(
            f"| {r['point']['variant']} | {'no cap' if factor is None else f'{factor:.1f}'} "
            f"| {fmt(tph['pearl'])} | "
            + " | ".join(fmt(tph[b]) for b in baselines)
            + f" | {fmt(best, '.3f')} | {fmt(vs_rlboost, '.3f')} "
            f"| {fmt(pol['pearl']['oracle_fraction'], '.3f')} |"
        )
    ample = [
        r
        for r in rows
        if r["elastic_over_base_rollout"] is None or r["elastic_over_base_rollout"] >= 1.0
    ]
    lines += [""]
    for name, w in result["worst_ratio"].items():
        lines.append(f"- pearl / {name}: worst {fmt(w['ratio'], '.3f')} at {w['point']['variant']}")
    lines += [
        f"- pearl at or above every baseline: {len(rows) - len(behind)} of {len(rows)} variants"
        + (f" (behind on {', '.join(behind)})" if behind else ""),
        f"- pearl >= 1.25x rlboost-plus where elastic supply >= the base rollout GPUs: "
        f"{len(ample) - short} of {len(ample)} variants",
        "",
        f"![{what} family](results-family-{what}.png)",
        "",
    ]
    return lines


def dev_cluster_section() -> list[str]:
    """The dev-cluster section from its committed figures (none measured: no section)."""
    if not dev_cluster_results.MEASURED.exists():
        return []
    measured = json.loads(dev_cluster_results.MEASURED.read_text(encoding="utf-8"))
    return dev_cluster_results.section(measured)


def commit() -> str:
    """The checkout the figures come from: its commit, marked when files differ from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], text=True, capture_output=True
    ).stdout.strip()
    return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def notes_only() -> int:
    """Put the current ``results_notes.md`` into docs/results.md, keeping its figures."""
    doc = ROOT / "docs" / "results.md"
    text = doc.read_text(encoding="utf-8")
    notes = NOTES.read_text(encoding="utf-8").strip()
    heading = notes.splitlines()[0]
    if heading not in text:
        print(f"{doc}: no {heading!r} section to replace", file=sys.stderr)
        return 2
    doc.write_text(text[: text.index(heading)] + notes + "\n", encoding="utf-8")
    print("rewrote the notes of docs/results.md", file=sys.stderr)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--notes-only"]:
        return notes_only()
    if sys.argv[1:2] == ["--dev-cluster"] and len(sys.argv) == 3:
        return dev_cluster_results.main(Path(sys.argv[2]))
    at = commit()  # before the runs: the tree may change while they take hours
    sections: list[str] = []
    for name in SCENARIOS:
        print(f"running {name} ...", file=sys.stderr)
        sections += scenario_section(name)
    for name, lead in PAPER_SCENARIOS.items():
        print(f"running {name} ...", file=sys.stderr)
        sections += scenario_section(name, lead, in_order=False)
    sections += ["## The scenario family", ""]
    for drawn in (False, True):
        print(f"running the {'drawn' if drawn else 'canonical'} family ...", file=sys.stderr)
        sections += family_section(drawn)
    speed = run_json(["bench", "sim", "--gpus", "256", "--sim-hours", "0.25", "--json"])
    text = [
        "# Results",
        "",
        f"Generated by `.venv/bin/python benchmarks/results.py` at commit {at} (do not edit",
        "by hand; the commentary comes from `benchmarks/results_notes.md`). Means over 3 seeds;",
        "each run simulates the scenario's `duration_s`; logs under `runs/results/`. Trajectories",
        "finish in waves (a batch's stragglers end together), so one run's throughput moves",
        "in steps of about one batch per run: 1,024 trajectories in 30 minutes, 2,048 traj/h.",
        "",
        *sections,
        *dev_cluster_section(),
        "## Simulation speed",
        "",
        "`pearl bench sim --gpus 256 --sim-hours 0.25 --json` (the 24-hour run of the target "
        "would take the projected time below):",
        "",
        "```json",
        json.dumps(speed.result, indent=2),
        "```",
        "",
        NOTES.read_text(encoding="utf-8").strip(),
        "",
    ]
    (ROOT / "docs" / "results.md").write_text("\n".join(text), encoding="utf-8")
    print("wrote docs/results.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
