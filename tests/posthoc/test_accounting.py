"""Slurm accounting: sacct rows folded into jobs, summed into waits, run times and GPU-hours.

Inline texts are written by hand with their figures worked out in the comments; the public
traces are checked against counts and sums computed here independently (csv, str.split).
"""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from trace_files import traces_or_skip

from pearl.analysis.accounting import (
    SacctUnavailable,
    array_size,
    gpus_of_gres,
    gpus_of_tres,
    main,
    normalise_state,
    parse_accounting,
    parse_eagle_csv,
    parse_sacct,
    query_sacct,
    role_of,
    select_jobs,
    summarize,
)
from pearl.cluster.slurm_text import SlurmTextError
from pearl.cluster.submission import Submission
from pearl.core.decision import ElasticRequest

RAW = "the sacct and Eagle fixtures are raw third-party files"

ROOT = Path(__file__).resolve().parents[2]
DCAST = "tdhock-slurm__slurm-dcast-agg.txt"
ALLCOLS = "tdhock-slurm__sacct-allcols.txt"
EAGLE = "eagle-jobs__sample_eagle_data.csv"

HEADER = "JobID|JobName|Partition|State|Submit|Start|End|Elapsed|AllocTRES|ReqTRES|NodeList|Comment"
D = "2024-05-01T"
ROWS = [
    # coordinator: waited 30 s, running for an hour, no GPU
    f"100|pearl-coordinator-qwen|cpu|RUNNING|{D}10:00:00|{D}10:00:30|Unknown|01:00:00|"
    "cpu=4|cpu=4|n01|",
    f"100.batch|batch||RUNNING||{D}10:00:30|Unknown|01:00:00|cpu=4||n01|",
    # base job, two heterogeneous components, 2 h each: 4 GPUs (train) and 8 GPUs (rollout)
    f"101+0|pearl-base|train|COMPLETED|{D}10:01:00|{D}10:02:00|{D}12:02:00|02:00:00|"
    "cpu=8,gres/gpu=4,gres/gpu:h800=4,node=1||g01|",
    f"101+0.batch|batch||COMPLETED||{D}10:02:00|{D}12:02:00|02:00:00|||g01|",
    f"101+1|pearl-base|rollout|COMPLETED|{D}10:01:00|{D}10:02:00|{D}12:02:00|02:00:00|"
    "gres/gpu:h800=8,node=2||g[02-03]|",
    f"101+1.0|python||COMPLETED||{D}10:02:00|{D}12:02:00|02:00:00|||g[02-03]|",
    # elastic, preempted after 30 min on 8 GPUs: it held 4 GPU-hours; waited 1800 s
    f"102|pearl-r1-el0001|spot|PREEMPTED|{D}10:10:00|{D}10:40:00|{D}11:10:00|00:30:00|"
    "gres/gpu=8|gres/gpu=8|g[04-05]|pearl:run=r1,allocation=el0001",
    # cancelled while pending (Slurm prints a start anyway): no wait, no run, elastic by comment
    f"103|renamed|spot|CANCELLED by 0|{D}10:10:00|{D}10:20:00|{D}10:20:00|00:00:00|"
    "|gres/gpu=2|None assigned|pearl:run=r1,allocation=el0002",
    # array tasks: a day on 2 GPUs (requested; nothing allocated printed) = 48 GPU-hours
    f"104_1|arr|cpu|OUT_OF_MEMORY|{D}09:00:00|{D}09:00:00|Unknown|1-00:00:00||gres/gpu:a100=2||",
    f"104_2|arr|cpu|NODE_FAIL|{D}09:00:00|{D}09:00:10|{D}09:00:20|00:00:10|cpu=1||n02|",
    f"104_[3-5%2]|arr|cpu|PENDING|{D}09:00:00|Unknown|Unknown|00:00:00|||None assigned|",
    f"105|odd|cpu|WEIRD_STATE|{D}09:00:00|{D}09:00:00|{D}09:00:01|00:00:01|||n03|",
    # a requeued elastic job printed twice (sacct --duplicates), 1 GPU for 1 h each time
    f"106|pearl-r1-el0003|spot|REQUEUED|{D}08:00:00|{D}08:00:00|{D}09:00:00|01:00:00|"
    "gres/gpu=1||g06|",
    f"106|pearl-r1-el0003|spot|RUNNING|{D}09:00:05|{D}09:00:15|Unknown|01:00:00|gres/gpu=1||g06|",
    f"106.batch|batch||RUNNING||{D}09:00:15|Unknown|01:00:00|||g06|",
    # a step whose job has no row
    f"107.0|x||COMPLETED||{D}09:00:00|{D}09:00:01|00:00:01|||n04|",
    # malformed rows: field count, job id, time, duration
    "108|too|few",
    f"10x|bad-id|cpu|COMPLETED|{D}09:00:00|{D}09:00:00|{D}09:00:01|00:00:01|||n05|",
    f"109|bad-time|cpu|COMPLETED|yesterday|{D}09:00:00|{D}09:00:01|00:00:01|||n05|",
    f"110|bad-elapsed|cpu|COMPLETED|{D}09:00:00|{D}09:00:00|{D}09:00:01|soon|||n05|",
]
TEXT = "\n".join([HEADER, *ROWS]) + "\n"


@pytest.fixture(scope="module")
def inline() -> dict[str, object]:
    return summarize(parse_sacct(TEXT, "inline"))


def test_rows_fold_into_jobs_components_and_incarnations(inline: dict[str, object]) -> None:
    # jobs: 100, 101, 102, 103, 104_1, 104_2, 104_[3-5%2], 105, 106
    assert inline["jobs"] == 9
    # records: those, plus 101+1 and 106's second incarnation
    assert inline["records"] == 11
    assert inline["steps"] == 4  # 100.batch, 101+0.batch, 101+1.0, 106.batch
    assert inline["orphan_steps"] == 1
    assert inline["tasks_in_pending_array_ranges"] == 3


def test_records_carry_array_tasks_het_components_and_steps() -> None:
    data = parse_sacct(TEXT)
    by_id = {(r.job_id, r.incarnation): r for r in data.records}
    assert by_id[("101+1", 0)].base_job_id == 101
    assert by_id[("101+1", 0)].het_component == 1
    assert by_id[("101+1", 0)].steps == 1
    assert by_id[("104_[3-5%2]", 0)].array_task == "[3-5%2]"
    assert by_id[("104_1", 0)].array_task == "1"
    assert by_id[("106", 0)].steps == 0
    assert by_id[("106", 1)].steps == 1
    assert by_id[("106", 1)].queue_wait_s == 10.0


def test_states_are_normalised_and_unknown_ones_kept(inline: dict[str, object]) -> None:
    assert inline["states"] == {
        "CANCELLED": 1,
        "COMPLETED": 2,
        "NODE_FAIL": 1,
        "OUT_OF_MEMORY": 1,
        "PENDING": 1,
        "PREEMPTED": 1,
        "REQUEUED": 1,
        "RUNNING": 2,
        "WEIRD_STATE": 1,
    }
    assert inline["unknown_states"] == {"WEIRD_STATE": 1}


def test_roles_of_the_jobs(inline: dict[str, object]) -> None:
    assert inline["roles"] == {"base": 1, "coordinator": 1, "elastic": 3, "other": 4}


def test_gpu_hours_by_partition_role_and_preemption(inline: dict[str, object]) -> None:
    gpu_hours = inline["gpu_hours"]
    assert isinstance(gpu_hours, dict)
    # train 4 x 2 h; rollout 8 x 2 h; spot 8 x 0.5 h + 0 (never ran) + 1 x 1 h + 1 x 1 h;
    # cpu: 2 requested GPUs x 24 h
    assert gpu_hours["by_partition"] == pytest.approx(
        {"cpu": 48.0, "rollout": 16.0, "spot": 6.0, "train": 8.0}
    )
    assert gpu_hours["by_role"] == pytest.approx(
        {"base": 24.0, "coordinator": 0.0, "elastic": 6.0, "other": 48.0}
    )
    assert gpu_hours["total"] == pytest.approx(78.0)
    assert inline["preemptions"] == {"count": 1, "gpu_hours": pytest.approx(4.0)}
    assert inline["requeues"] == {"count": 1, "jobs": 1, "records_in_state_requeued": 1}


def test_queue_wait_skips_jobs_that_never_started(inline: dict[str, object]) -> None:
    # started: 100 (30), 101+0 (60), 101+1 (60), 102 (1800), 104_1 (0), 104_2 (10),
    # 105 (0), 106 (0), 106 again (10); 103 never got a node, 104_[3-5] is pending
    waits = [30, 60, 60, 1800, 0, 10, 0, 0, 10]
    stats = inline["queue_wait_s"]
    assert isinstance(stats, dict)
    assert stats["n"] == len(waits)
    assert stats["mean"] == pytest.approx(statistics.mean(waits))
    assert stats["p50"] == pytest.approx(statistics.median(waits))
    assert stats["max"] == 1800


def test_malformed_rows_are_skipped_and_named(inline: dict[str, object]) -> None:
    assert inline["skipped_rows"] == 4
    examples = inline["skipped_examples"]
    assert isinstance(examples, list)
    first_bad = 1 + ROWS.index("108|too|few") + 1  # header is line 1
    assert examples[0].startswith(f"line {first_bad}: ")
    assert "JobID" in examples[1]
    assert "yesterday" in examples[2]
    assert "soon" in examples[3]


def test_summary_is_json() -> None:
    summary = summarize(parse_sacct(TEXT))
    assert json.loads(json.dumps(summary)) == summary


def test_a_header_without_job_ids_is_an_error_and_empty_input_is_empty() -> None:
    with pytest.raises(SlurmTextError):
        parse_sacct("User|State\nme|RUNNING\n")
    assert summarize(parse_sacct(""))["jobs"] == 0


@pytest.mark.parametrize(
    ("raw", "state"),
    [("CANCELLED by 0", "CANCELLED"), ("CANCELLED+", "CANCELLED"), (" TIMEOUT ", "TIMEOUT")],
)
def test_normalise_state(raw: str, state: str) -> None:
    assert normalise_state(raw) == state


@pytest.mark.parametrize(
    ("tres", "gpus"),
    [
        ("billing=1,cpu=1,mem=7996M,node=1", 0),
        ("cpu=8,gres/gpu=4,node=1", 4),
        ("gres/gpu=4,gres/gpu:h100=4", 4),  # the same GPUs, untyped and typed
        ("gres/gpu:h100=4,gres/gpu:a100=2", 6),
    ],
)
def test_gpus_of_tres(tres: str, gpus: int) -> None:
    assert gpus_of_tres(tres) == gpus


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [("gpu:4", 4), ("gpu:h100:4(IDX:0,2-4)", 4), ("gpu", 1), ("gpu:a100:2,mps:100", 2)],
)
def test_gpus_of_gres(gres: str, gpus: int) -> None:
    assert gpus_of_gres(gres) == gpus


@pytest.mark.parametrize(
    ("task", "size"),
    [(None, 1), ("4", 1), ("[4427-7213]", 2787), ("[1-3,7]", 4), ("[0-9:2]", 5), ("[1-99%5]", 99)],
)
def test_array_size(task: str | None, size: int) -> None:
    assert array_size(task) == size


def test_roles_match_what_pearl_submits() -> None:
    request = ElasticRequest(num_gpus=8, gpu_type="h100", partition="spot", time_limit_min=60)
    s = Submission("run-1.b", "el0007", request, gpus_per_node=8)
    assert role_of(s.job_name) == "elastic"
    assert role_of("renamed-by-hand", s.comment) == "elastic"
    sbatch = (ROOT / "slurm" / "base-job.sbatch").read_text()
    base_name = re.search(r"--job-name=(\S+)", sbatch)
    assert base_name is not None
    assert role_of(base_name.group(1)) == "base"
    submit = (ROOT / "launch" / "submit.py").read_text()
    coordinator = re.search(r'name=f"(pearl-coordinator-)\{', submit)
    assert coordinator is not None
    assert role_of(coordinator.group(1) + "qwen3") == "coordinator"
    assert role_of("pearl-notes") == "other"


# --- the public traces ------------------------------------------------------------------


def test_allcols_job_against_slurms_own_columns() -> None:
    path = traces_or_skip(RAW) / ALLCOLS
    rows = list(csv.DictReader(path.open(encoding="utf-8"), delimiter="\t"))
    job = next(r for r in rows if "." not in r["JobID"])
    data = parse_sacct(path.read_text(encoding="utf-8"))
    (record,) = data.records
    assert record.job_id == job["JobID"]
    assert record.state == job["State"] == "TIMEOUT"
    assert record.partition == job["Partition"]
    assert record.steps == len(rows) - 1
    wait = datetime.fromisoformat(job["Start"]) - datetime.fromisoformat(job["Submit"])
    assert record.queue_wait_s == wait.total_seconds()
    # Slurm's own "Reserved" column is start - eligible (here eligible = submit): 00:01:01
    h, m, s = (int(x) for x in job["Reserved"].split(":"))
    assert record.queue_wait_s == h * 3600 + m * 60 + s
    assert record.run_s == int(job["ElapsedRaw"])
    assert "gres/gpu" not in job["AllocTRES"]
    assert record.gpus == 0


def test_dcast_array_jobs_counted_independently() -> None:
    path = traces_or_skip(RAW) / DCAST
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    fields = [line.split("|") for line in lines]
    jobs = [f for f in fields if "." not in f[0]]
    summary = summarize(parse_sacct(path.read_text(encoding="utf-8"), DCAST))
    assert summary["jobs"] == summary["records"] == len(jobs)
    assert summary["steps"] == len(fields) - len(jobs)
    assert summary["skipped_rows"] == summary["orphan_steps"] == 0
    assert summary["states"] == dict(Counter(f[2] for f in jobs))
    (pending,) = [f[0] for f in jobs if "[" in f[0]]
    lo, hi = (int(x) for x in pending.split("[")[1].rstrip("]").split("-"))
    assert summary["tasks_in_pending_array_ranges"] == hi - lo + 1

    def seconds(hms: str) -> int:
        h, m, s = (int(x) for x in hms.split(":"))
        return h * 3600 + m * 60 + s

    run = summary["run_s"]
    assert run["max"] == max(seconds(f[4]) for f in jobs)
    assert run["mean"] == pytest.approx(statistics.mean(seconds(f[4]) for f in jobs))
    assert summary["queue_wait_s"]["n"] == 0  # no time columns in this file


def test_eagle_sample_against_the_csv() -> None:
    path = traces_or_skip(RAW) / EAGLE
    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    data = parse_accounting(path.read_text(encoding="utf-8"), EAGLE)
    assert data == parse_eagle_csv(path.read_text(encoding="utf-8"), EAGLE)
    summary = summarize(data)
    assert summary["jobs"] == len(rows) == 1000
    assert summary["skipped_rows"] == 0
    assert summary["states"] == dict(sorted(Counter(r["state"] for r in rows).items()))
    gpu_hours: dict[str, float] = {}
    for r in rows:
        hours = int(r["gpus_req"]) * float(r["run_time"]) / 3600
        gpu_hours[r["partition"]] = gpu_hours.get(r["partition"], 0.0) + hours
    assert summary["gpu_hours"]["by_partition"] == pytest.approx(gpu_hours)
    # by hand: 2 GPUs x (902 + 923 + 2714) s + 16 GPUs x 1713 s on partition007
    assert summary["gpu_hours"]["total"] == pytest.approx((2 * 4539 + 16 * 1713) / 3600)
    fmt = "%Y-%m-%d %H:%M:%S"
    waits = [
        (datetime.strptime(r["start_time"], fmt) - datetime.strptime(r["submit_time"], fmt))
        for r in rows
    ]
    assert summary["queue_wait_s"]["p50"] == statistics.median(w.total_seconds() for w in waits)
    assert summary["queue_wait_s"]["max"] == max(w.total_seconds() for w in waits)


def test_eagle_rows_that_do_not_parse_are_skipped() -> None:
    text = (
        "job_id,partition,submit_time,start_time,end_time,run_time,state,gpus_req\n"
        "1,p,2019-01-01 00:00:00,2019-01-01 00:01:00,2019-01-01 01:01:00,3600,COMPLETED,2\n"
        "2,p,2019-01-01 00:00:00,never,2019-01-01 01:01:00,3600,COMPLETED,2\n"
        "3,p,2019-01-01 00:00:00\n"
        "4,p,2019-01-01 00:00:00,2019-01-01 00:01:00,2019-01-01 01:01:00,-5,COMPLETED,2\n"
    )
    data = parse_eagle_csv(text)
    assert [r.job_id for r in data.records] == ["1"]
    assert data.records[0].gpu_hours == 2.0
    assert data.records[0].queue_wait_s == 60.0
    assert data.skipped_rows == 3
    assert data.skipped_examples[0].startswith("line 3: ")


# --- command line and sacct -------------------------------------------------------------


def test_cli_prints_a_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sacct.txt"
    path.write_text(TEXT)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "jobs: 9 " in out
    assert "preemptions: 1 (their jobs held 4.00 GPU-h)" in out
    monkeypatch.setattr(sys, "stdin", io.StringIO(TEXT))
    assert main(["-", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_hours"]["total"] == pytest.approx(78.0)


@pytest.mark.parametrize("content", [None, "User|State\nme|RUNNING\n", b"\xff\xfe|\x00"])
def test_cli_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None
) -> None:
    path = tmp_path / "in.txt"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"{path}: ")


def test_the_script_over_job_logs_runs(tmp_path: Path) -> None:
    """``python analysis/accounting.py FILE``, as a user runs it over a job's sacct file."""
    path = tmp_path / "sacct.txt"
    path.write_text(TEXT)
    done = subprocess.run(
        [sys.executable, str(ROOT / "analysis" / "accounting.py"), str(path), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["jobs"] == 9


def test_select_jobs_keeps_named_and_listed_jobs_with_their_steps() -> None:
    kept = select_jobs(TEXT, "pearl-r1-", ["100"])
    ids = [line.split("|")[0] for line in kept.splitlines()[1:]]
    assert ids == ["100", "100.batch", "102", "106", "106", "106.batch"]  # 103 is "renamed"
    assert kept.splitlines()[0] == HEADER


def test_query_sacct_runs_sacct_and_filters(tmp_path: Path) -> None:
    args_file = tmp_path / "args"
    out_file = tmp_path / "out"
    out_file.write_text(TEXT)
    fake = tmp_path / "sacct"
    fake.write_text(f'#!/bin/sh\necho "$@" > {args_file}\ncat {out_file}\n')
    fake.chmod(0o755)
    text = query_sacct("r1", ["101"], sacct=str(fake))
    args = args_file.read_text()
    assert "--parsable2" in args and "--duplicates" in args and "-S now-30days" in args
    assert "JobID,JobName,Partition,State,Submit" in args
    assert "-X" not in args.split()  # steps are wanted
    summary = summarize(parse_sacct(text))
    assert summary["roles"] == {"base": 1, "elastic": 2}
    assert summarize(parse_sacct(query_sacct(None, None, sacct=str(fake))))["jobs"] == 9


def test_query_sacct_without_sacct_or_with_a_failing_one(tmp_path: Path) -> None:
    with pytest.raises(SacctUnavailable, match="not found"):
        query_sacct("r1", None, sacct=str(tmp_path / "no-sacct"))
    failing = tmp_path / "sacct"
    failing.write_text("#!/bin/sh\necho 'slurmdbd: down' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(SacctUnavailable, match="slurmdbd: down"):
        query_sacct("r1", None, sacct=str(failing))
