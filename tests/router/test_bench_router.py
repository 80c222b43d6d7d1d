"""``pearl bench router --json`` runs end to end on small settings and reports what it
promises (no speed is asserted): overhead quantiles, and a P:D change with its losses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_bench_router_json() -> None:
    argv = [sys.executable, "-m", "pearl.cli.main", "bench", "router", "--json"]
    argv += ["--turns", "20", "--trajectories", "3", "--phase-s", "0.5"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=True)
    result = json.loads(out.stdout)
    o = result["overhead"]
    assert o["turns"] == 20 and set(o["overhead_ms"]) == {"p50", "p99", "mean"}
    assert isinstance(o["target_met"], bool)
    pd = result["pd_change"]
    assert pd["lost_trajectories"] == 0, pd["errors"]
    assert pd["turns_per_s"]["disaggregated"] > 0  # turns ran in the disaggregated phase
    assert set(pd["longest_gap_s"]) == {"to_pd", "back"}


def test_bad_arguments_are_one_line_and_exit_2() -> None:
    argv = [sys.executable, "-m", "pearl.cli.main", "bench", "router", "--turns", "1"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
