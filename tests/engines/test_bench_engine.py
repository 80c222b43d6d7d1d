"""``pearl bench engine --json`` at very small settings: the fields are there, and the PD
decode instance computed no prompt token (its own metrics). No speed is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the naive baseline needs transformers (dev extra)")


def test_bench_engine_json(tiny_model_dir: Path) -> None:
    argv = [sys.executable, "-m", "pearl.cli.main", "bench", "engine", "--json"]
    argv += ["--model", str(tiny_model_dir), "--concurrency", "1,4", "--max-tokens", "4"]
    argv += ["--prompt-tokens", "32", "--pd-requests", "2", "--threads", "1", "--settle-s", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert [d["concurrency"] for d in result["decode"]] == [1, 4]
    for row in result["decode"]:
        assert row["generated_tokens"] == 4 * row["concurrency"]
        for key in ("engine_tokens_per_s", "naive_tokens_per_s", "ratio", "ratio_vs_naive_best"):
            assert row[key] > 0
    assert result["prefill"]["engine_tokens_per_s"] > 0
    assert result["prefill"]["naive_tokens_per_s"] > 0
    assert result["target"]["target_met"] is None  # 32 is not among the concurrencies
    pd = result["pd"]
    assert pd["requests"] == 2 and pd["generated_tokens"] == 8
    assert pd["decode_prompt_tokens_total_delta"] == 2 * 32
    assert pd["decode_prompt_tokens_computed_delta"] == 0
    assert pd["decode_computed_no_prompt"] is True
    assert pd["kv_pulls"] == 2 and pd["kv_bytes"] > 0
    assert pd["kv_xfer_ms_per_mb"] is not None and pd["kv_xfer_ms_per_mb"] >= 0
