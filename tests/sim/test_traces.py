"""Readers of the public traces: the real files, and one-line errors on malformed ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from trace_files import traces_or_skip

from pearl.io.documents import InputError
from pearl.io.traces import (
    AZURE_CONV,
    HELIOS_VC,
    MOONCAKE_CONV,
    TRACELAB_ROUNDS,
    TRACELAB_SESSIONS,
    read_azure_lengths,
    read_helios_idle,
    read_mooncake_lengths,
    read_swe_agent_latencies_s,
    read_tracelab_rounds,
    read_tracelab_sessions,
    traces_dir,
)

RAW = "the raw trace readers parse the raw files"


def test_traces_dir_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEARL_TRACES", "/somewhere/else")
    assert traces_dir() == Path("/somewhere/else")
    monkeypatch.delenv("PEARL_TRACES")
    repo = Path(__file__).resolve().parents[2]
    assert traces_dir() == repo.parent / "shared" / "traces"  # beside the repository


def test_tracelab_sessions() -> None:
    s = read_tracelab_sessions(traces_or_skip(RAW) / TRACELAB_SESSIONS)
    assert s.input_len.size == 303
    turns = s.turns_per_session()
    assert turns.size == 48 and turns.sum() == 303 and turns.min() >= 1
    same = s.session_id[1:] == s.session_id[:-1]
    # the context relation the trajectory model relies on
    grown = s.prefix_len[:-1] + s.input_len[:-1] + s.output_len[:-1]
    assert np.array_equal(s.prefix_len[1:][same], grown[same])


def test_tracelab_rounds() -> None:
    r = read_tracelab_rounds(traces_or_skip(RAW) / TRACELAB_ROUNDS)
    assert r.output_tokens.size == 19
    assert np.all(r.tool_latency_ms[r.num_tools == 0] == 0)
    assert np.all(r.tool_latency_ms[r.num_tools > 0] > 0)


def test_swe_agent_steps() -> None:
    paths = sorted(traces_or_skip(RAW).glob("SWE-agent__*.traj"))
    latencies = [read_swe_agent_latencies_s(p) for p in paths]
    assert [x.size for x in latencies] == [13, 0]  # the gpt4 trajectory records no times
    assert np.all((latencies[0] > 0.05) & (latencies[0] < 5))


def test_request_lengths() -> None:
    azure = read_azure_lengths(traces_or_skip(RAW) / AZURE_CONV)
    mooncake = read_mooncake_lengths(traces_or_skip(RAW) / MOONCAKE_CONV)
    assert azure.input_tokens.size == 19366  # as the traces README says
    assert mooncake.input_tokens.size == 12031
    assert np.median(azure.input_tokens) == 1020 and np.median(azure.output_tokens) == 129


def test_helios_series() -> None:
    series = read_helios_idle(traces_or_skip(RAW) / HELIOS_VC)
    assert series.idle_gpus.size == 44640
    assert np.all(np.diff(series.time_s) == 60.0) and series.time_s[0] == 0.0
    assert series.idle_gpus.min() >= 0 and series.idle_gpus.max() <= 56


SESSION_HEADER = (
    "session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms"
)


@pytest.mark.parametrize(
    ("name", "text", "reader", "field", "problem"),
    [
        pytest.param(
            "s.csv",
            "session_id,round_idx\n0,0\n",
            read_tracelab_sessions,
            "prefix_len",
            "missing column",
            id="sessions-missing-column",
        ),
        pytest.param(
            "s.csv",
            SESSION_HEADER + "\n0,1,0,0,12x,5,0\n",
            read_tracelab_sessions,
            "line 2 input_len",
            "expected a number",
            id="sessions-not-a-number",
        ),
        pytest.param(
            "s.csv",
            SESSION_HEADER + "\n0,1,0,0,-3,5,0\n",
            read_tracelab_sessions,
            "line 2 input_len",
            ">= 0",
            id="sessions-negative",
        ),
        pytest.param(
            "s.csv",
            SESSION_HEADER + "\n",
            read_tracelab_sessions,
            "",
            "no data rows",
            id="sessions-empty",
        ),
        pytest.param(
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\nx,1.5,3\n",
            read_azure_lengths,
            "line 2 ContextTokens",
            "expected an integer",
            id="azure-fraction",
        ),
        pytest.param(
            "m.jsonl",
            '{"input_length": 5, "output_length": 2}\n{"input_length": 5,\n',
            read_mooncake_lengths,
            "line 2",
            "malformed JSON",
            id="mooncake-broken-line",
        ),
        pytest.param(
            "m.jsonl",
            '{"input_length": 5}\n',
            read_mooncake_lengths,
            "line 1 output_length",
            "expected a number",
            id="mooncake-missing-key",
        ),
        pytest.param(
            "r.jsonl",
            '{"round_index": 0, "prefix_tokens": 1, "newly_append_tokens": 2, '
            '"output_tokens": 3, "tools": [{"tool_wall_latency_ms": "slow"}]}\n',
            read_tracelab_rounds,
            "line 1 tools[0].tool_wall_latency_ms",
            "expected a number",
            id="rounds-bad-latency",
        ),
        pytest.param(
            "t.traj",
            '{"trajectory": [{"execution_time": true}]}',
            read_swe_agent_latencies_s,
            "trajectory[0].execution_time",
            "expected a number",
            id="swe-bool",
        ),
        pytest.param(
            "t.traj",
            '{"history": []}',
            read_swe_agent_latencies_s,
            "trajectory",
            "expected a list",
            id="swe-no-trajectory",
        ),
        pytest.param(
            "h.csv",
            "time,idle_gpu_num\n2020-05-01 00:01:00,3\n2020-05-01 00:00:00,4\n",
            read_helios_idle,
            "line 3 time",
            "times must increase",
            id="helios-backwards",
        ),
        pytest.param(
            "h.csv",
            "time,idle_gpu_num\nyesterday,3\n",
            read_helios_idle,
            "line 2 time",
            "not a time",
            id="helios-bad-time",
        ),
    ],
)
def test_malformed_files_name_file_field_and_problem(
    tmp_path: Path, name: str, text: str, reader: Callable[[Path], object], field: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as err:
        reader(path)
    assert err.value.path == str(path)
    assert err.value.field == field
    assert problem in err.value.problem
    assert "\n" not in str(err.value)


def test_a_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        read_azure_lengths(tmp_path / "absent.csv")
    with pytest.raises(InputError, match="cannot read"):
        read_mooncake_lengths(tmp_path / "absent.jsonl")
