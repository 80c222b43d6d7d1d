"""Bit-for-bit identity of the simulator's results against a reference taken earlier.

Runs ``pearl simulate`` (every reported policy, seeds 0-1, ``--duration-s 600``) on each
shipped scenario and on two variants of each: ``rollout.batching: in-order`` and short
outputs (``rollout.workload.output_tokens_per_turn: 27.9``). Each run writes its
``summary.json`` (every run's metrics and the oracle's bound; no wall time is in it) and
its run logs (``POLICY/seedN.jsonl``). ``--record DIR`` keeps them as the reference;
``--check DIR`` runs again and compares every file byte for byte. A speed-up of the
simulator must leave every file unchanged.

Usage::

    .venv/bin/python benchmarks/sim_identity.py --record /tmp/sim-ref   # before a change
    .venv/bin/python benchmarks/sim_identity.py --check /tmp/sim-ref    # after it

Prints JSON: per variant, the CPU seconds of its ``pearl simulate`` and, with
``--check``, the files that differ (``identical``: none differs anywhere).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import yaml

from pearl.cli.main import main as pearl_main

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("qwen3-8b", "qwen3-30b-a3b")
VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "in-order": {"batching": "in-order"},
    "short": {"workload": {"output_tokens_per_turn": 27.9}},
}
SEEDS = 2
DURATION_S = 600


def variant_document(scenario: str, rollout_update: dict[str, Any]) -> dict[str, Any]:
    path = ROOT / "benchmarks" / "scenarios" / f"{scenario}.yaml"
    doc: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    for key, value in rollout_update.items():
        if isinstance(value, dict):
            doc["rollout"][key].update(value)
        else:
            doc["rollout"][key] = value
    return doc


def run_all(out: Path, only: str | None) -> dict[str, float]:
    """Every variant's ``pearl simulate`` into ``out/NAME``; CPU seconds per variant."""
    cpu_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in SCENARIOS:
            for variant, update in VARIANTS.items():
                name = f"{scenario}-{variant}"
                if only is not None and only not in name:
                    continue
                path = Path(tmp) / f"{name}.yaml"
                path.write_text(yaml.safe_dump(variant_document(scenario, update)), "utf-8")
                args = [
                    "simulate",
                    str(path),
                    "--seeds",
                    str(SEEDS),
                    "--duration-s",
                    str(DURATION_S),
                    "--out",
                    str(out / name),
                    "--json",
                    "--jobs",  # in this process: its CPU time is the runs', and the
                    "1",  # summary's ``jobs`` the reference's
                ]
                start_s = time.process_time()
                with open(os.devnull, "w") as quiet, redirect_stdout(quiet), redirect_stderr(quiet):
                    status = pearl_main(args)  # stdout is this script's JSON
                if status != 0:
                    raise SystemExit(f"pearl simulate {name}: exit status {status}")
                cpu_s[name] = round(time.process_time() - start_s, 2)
    return cpu_s


def differing(reference: Path, candidate: Path) -> list[str]:
    """Files of either tree that are missing from the other or differ in a byte."""
    ref_files = {p.relative_to(reference) for p in reference.rglob("*") if p.is_file()}
    new_files = {p.relative_to(candidate) for p in candidate.rglob("*") if p.is_file()}
    out = [str(p) for p in sorted(ref_files ^ new_files)]
    for rel in sorted(ref_files & new_files):
        if not filecmp.cmp(reference / rel, candidate / rel, shallow=False):
            out.append(str(rel))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, help="write the reference here")
    mode.add_argument("--check", type=Path, help="compare with the reference here")
    parser.add_argument("--only", default=None, help="variants whose name contains this")
    args = parser.parse_args()
    if args.record is not None:
        if args.record.exists():
            shutil.rmtree(args.record)
        cpu_s = run_all(args.record, args.only)
        print(json.dumps({"recorded": str(args.record), "cpu_s": cpu_s}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cpu_s = run_all(Path(tmp), args.only)
        diffs: dict[str, list[str]] = {}
        for name in cpu_s:
            diffs[name] = differing(args.check / name, Path(tmp) / name)
    identical = not any(diffs.values())
    print(json.dumps({"identical": identical, "cpu_s": cpu_s, "differing": diffs}))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
