"""The dev-cluster section of docs/results.md: ``pearl run`` on Slurm, pearl beside
``roll-fixed`` (``benchmarks/slurm_run_pair.sh``).

    sudo benchmarks/slurm_run_pair.sh /tmp/pearl-slurm-pair          # about 8 minutes
    .venv/bin/python benchmarks/results.py --dev-cluster /tmp/pearl-slurm-pair

The second command keeps the figures of each run's ``pearl analyze --json --sacct-query``
in ``benchmarks/measured/dev-cluster-pair.json`` (committed: the whole ``results.py``
renders the section from it) and rewrites the section of docs/results.md. Nothing in the
section is typed by hand.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "measured" / "dev-cluster-pair.json"
HEADING = "## pearl run on the dev cluster"
POLICIES = ("pearl", "roll-fixed")


def summarize(pair_dir: Path) -> dict[str, Any]:
    """The figures the section shows, from ``PAIR_DIR/POLICY/analyze.json``."""
    out: dict[str, Any] = {
        "measured": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "command": "benchmarks/slurm_run_pair.sh (examples/runs/dev-cluster.yaml, 10 updates)",
        "policies": {},
    }
    for policy in POLICIES:
        doc = json.loads((pair_dir / policy / "analyze.json").read_text(encoding="utf-8"))
        (run,) = doc["runs"]
        pd, el, bw = run["pd"], run["elastic"], run["borrow"]
        out["policies"][policy] = {
            "run_s": run["run"]["duration_s"],
            "updates": run["training"]["train_steps"],
            "traj_per_h": run["throughput"]["throughput_traj_per_h"],
            "tokens_per_s": run["throughput"]["tokens_per_s"],
            "elastic_grants": el["granted"],
            "elastic_preempted": el["preempted"],
            "elastic_granted_gpu_h": el["granted_gpu_hours"],
            "elastic_used_gpu_h": el["used_gpu_hours"],
            "borrow_windows": bw["windows"],
            "max_trainer_wait_s": bw["trainer_wait"]["max_s"],
            "configurations": [_label(c) for c in pd["configurations"]],
            "trajectories_lost": run.get("rollout_turns", {}).get("trajectories_lost"),
            "plan_steps": pd["plan_steps"],
            "plan_steps_failed": pd["plan_steps_failed"],
            "plan_steps_s": pd["plan_steps_s"],
            "plan_steps_share": pd["plan_steps_share"],
            "decide_calls": pd["decide_calls"],
            "decide_ms_mean": pd["decide_ms_mean"],
            "decide_share": pd["decide_share"],
            "batch_mape": run["batches"]["prediction"]["mape"],
            "sacct_gpu_h": doc["accounting"]["gpu_hours"]["by_role"],
            "sacct_states": doc["accounting"]["states"],
        }
    return out


def _label(c: dict[str, Any]) -> str:
    return f"{c['C']}C" if c["C"] else f"{c['P']}P:{c['D']}D"


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def section(m: dict[str, Any]) -> list[str]:
    p = m["policies"]
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("run (s)", lambda r: _f(r["run_s"], ".1f")),
        ("updates", lambda r: str(r["updates"])),
        ("trajectories / h", lambda r: _f(r["traj_per_h"], ",.0f")),
        ("generated tokens / s", lambda r: _f(r["tokens_per_s"], ",.0f")),
        (
            "elastic grants (preempted)",
            lambda r: f"{r['elastic_grants']} ({r['elastic_preempted']})",
        ),
        (
            "elastic GPU-h granted / used by engines",
            lambda r: f"{r['elastic_granted_gpu_h']:.3f} / {r['elastic_used_gpu_h']:.3f}",
        ),
        (
            "borrow windows (trainer's longest wait, s)",
            lambda r: f"{r['borrow_windows']} ({_f(r['max_trainer_wait_s'], '.2f')})",
        ),
        ("PD configurations", lambda r: ", ".join(r["configurations"])),
        ("trajectories lost", lambda r: str(r["trajectories_lost"])),
        (
            "plan steps, failed (their summed time, share of the run)",
            lambda r: (
                f"{r['plan_steps']}, {r['plan_steps_failed']} "
                f"({_f(r['plan_steps_s'], '.1f')} s, {_f(r['plan_steps_share'], '.1%')})"
            ),
        ),
        (
            "decide() calls (mean time, share of the run)",
            lambda r: (
                f"{r['decide_calls']} ({_f(r['decide_ms_mean'], '.1f')} ms, "
                f"{_f(r['decide_share'], '.1%')})"
            ),
        ),
        ("batch-time MAPE", lambda r: _f(r["batch_mape"], ".2f")),
        (
            "sacct GPU-h: base / elastic",
            lambda r: (
                f"{r['sacct_gpu_h'].get('base', 0):.3f} / {r['sacct_gpu_h'].get('elastic', 0):.3f}"
            ),
        ),
        ("sacct job states", lambda r: ", ".join(f"{k} {v}" for k, v in r["sacct_states"].items())),
    ]
    ratio = p["pearl"]["traj_per_h"] / p["roll-fixed"]["traj_per_h"]
    lines = [
        HEADING,
        "",
        f"`{m['command']}`, then `pearl analyze --json --sacct-query` of each run "
        f"(measured {m['measured']}, {m['machine']}; the dev cluster's nodes are this "
        "machine). pearl's run has its first elastic node taken back by its owner once its "
        "engines serve.",
        "",
        "| | pearl | roll-fixed |",
        "|---|---|---|",
        *(f"| {name} | {cell(p['pearl'])} | {cell(p['roll-fixed'])} |" for name, cell in rows),
        "",
        f'pearl / roll-fixed: {ratio:.3f}x trajectories per hour. The dev cluster\'s "GPUs" '
        "share this machine's cores, so an elastic grant adds engine processes, not compute: "
        'no gain is expected here (docs/slurm-run.md, "Measured").',
        "",
    ]
    return lines


def rewrite(doc: Path, lines: list[str]) -> None:
    """Replace the section of ``doc`` (or put it before "## Simulation speed")."""
    text = doc.read_text(encoding="utf-8")
    block = "\n".join(lines)
    if HEADING in text:
        start = text.index(HEADING)
        nxt = text.find("\n## ", start + len(HEADING))
        end = len(text) if nxt < 0 else nxt + 1
        text = text[:start] + block + text[end:]
    else:
        at = text.index("## Simulation speed")
        text = text[:at] + block + text[at:]
    doc.write_text(text, encoding="utf-8")


def main(pair_dir: Path) -> int:
    measured = summarize(pair_dir)
    MEASURED.parent.mkdir(parents=True, exist_ok=True)
    MEASURED.write_text(json.dumps(measured, indent=2) + "\n", encoding="utf-8")
    rewrite(ROOT / "docs" / "results.md", section(measured))
    return 0
