"""``pearl profile fit`` against a started reference engine with a tiny sweep: the written
profile loads with pearl's loader and the held-out error is reported (finite)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pearl.io.documents import load_profile


def test_profile_fit_writes_a_loadable_profile(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="needs the engine extra")
    from pearl.bench.engine_proc import EngineProcess

    out_file = tmp_path / "fitted.yaml"
    with EngineProcess(tiny_model_dir, threads=1, log_dir=tmp_path) as engine:
        engine.wait_healthy()
        argv = [sys.executable, "-m", "pearl.cli.main", "profile", "fit", "--json"]
        argv += ["--engine", engine.url, "--out", str(out_file)]
        argv += ["--batch-sizes", "1,2,4", "--context-tokens", "16,48", "--decode-tokens", "3"]
        argv += ["--holdout", "2x16,1x48"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert sorted(result["held_out_points"]) == ["1x48", "2x16"]
    assert len(result["fitted_points"]) == 4
    for quantity in ("prefill", "decode_step"):
        assert math.isfinite(result["held_out_mape"][quantity])
    profile = load_profile(str(out_file))
    engine_profile = profile.engine("cpu", 1)
    assert engine_profile is not None
    assert engine_profile.model_dump(mode="json") == result["coefficients"]
    assert profile.kv_capacity_tokens("cpu", 1) == 65536


def test_profile_fit_rejects_a_holdout_outside_the_sweep(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pearl.cli.main", "profile", "fit", "--engine"]
    argv += ["http://127.0.0.1:9", "--out", str(tmp_path / "p.yaml"), "--holdout", "3x7"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--holdout" in out.stderr
