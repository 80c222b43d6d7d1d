"""Parsing sacct and squeue output and Slurm host lists; recorded output from real clusters."""

from __future__ import annotations

from collections import Counter
from datetime import datetime

import pytest
from trace_files import traces_or_skip

from pearl.cluster.slurm_text import (
    SQUEUE_FORMAT,
    JobId,
    SlurmTextError,
    expand_hostlist,
    parse_duration_s,
    parse_job_id,
    parse_sacct,
    parse_squeue,
)

RAW = "the recorded sacct output is a raw third-party file"

DCAST = "tdhock-slurm__slurm-dcast-agg.txt"  # 20,830 rows of JobID|ExitCode|State|MaxRSS|Elapsed
ALLCOLS = "tdhock-slurm__sacct-allcols.txt"  # one job, --format=ALL, tab-separated


def test_recorded_sacct_of_an_array_job() -> None:
    rows = parse_sacct((traces_or_skip(RAW) / DCAST).read_text(encoding="utf-8"))
    assert len(rows) == 20_830
    # Counted independently with awk -F'|' on the file.
    assert Counter(r.state for r in rows) == {
        "RUNNING": 6239,
        "FAILED": 5962,
        "COMPLETED": 4863,
        "OUT_OF_MEMORY": 3765,
        "PENDING": 1,
    }
    assert Counter((r.exit_code, r.exit_signal) for r in rows) == {
        (0, 0): 11103,
        (1, 0): 5962,
        (0, 125): 3765,
    }
    first = rows[0]
    assert first.job_id == JobId(7869917, "0") and first.elapsed_s == 34.0
    assert rows[1].job_id == JobId(7869917, "0", step="batch") and rows[1].job_id.is_step
    pending = [r for r in rows if r.state == "PENDING"]
    assert pending[0].job_id == JobId(7870209, "[4427-7213]")
    # Job rows (no step), per array job: awk -F'|' '$1 !~ /\./' gives 943 and 6,001.
    jobs = Counter(r.job_id.job for r in rows if not r.job_id.is_step)
    assert jobs == {7869917: 943, 7870209: 6001}


def test_recorded_sacct_with_every_column() -> None:
    rows = parse_sacct((traces_or_skip(RAW) / ALLCOLS).read_text(encoding="utf-8"))
    assert rows and all(len(r.fields) == 108 for r in rows)
    job = rows[0]
    assert job.job_id.job == 32650736 and not job.job_id.is_step
    assert job.fields["Account"] == "rpp-kenclark_cpu"
    assert job.fields["NodeList"] == "cdr735"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", JobId(123)),
        ("123_4", JobId(123, "4")),
        ("123_[4-9%2]", JobId(123, "[4-9%2]")),
        ("123+1", JobId(123, het_component=1)),
        ("123.batch", JobId(123, step="batch")),
        ("123_4.0", JobId(123, "4", step="0")),
        ("123+0.extern", JobId(123, het_component=0, step="extern")),
    ],
)
def test_job_ids(text: str, expected: JobId) -> None:
    assert parse_job_id(text) == expected


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:00:34", 34.0),
        ("1-02:03:04", 93784.0),
        ("05:30", 330.0),
        ("21:33.052", 1293.052),
        ("UNLIMITED", None),
        ("", None),
    ],
)
def test_durations(text: str, seconds: float | None) -> None:
    assert parse_duration_s(text) == (pytest.approx(seconds) if seconds else seconds)


def test_host_lists() -> None:
    assert expand_hostlist("node[01-03,07],gpu5") == (
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu5",
    )
    assert expand_hostlist("dev-h20-[1-2]") == ("dev-h20-1", "dev-h20-2")
    assert expand_hostlist("cdr735") == ("cdr735",)
    with pytest.raises(SlurmTextError, match="nodelist"):
        expand_hostlist("n[a-b]")


def test_squeue_rows() -> None:
    assert SQUEUE_FORMAT.count("|") == 8
    text = (
        "101|RUNNING|None|2026-11-29T10:00:00|dev-h20-[1-2]|elastic|pearl-r1-el0001"
        "|2026-11-29T11:00:00|1:00:00\n"
        "102|PENDING|Priority|2026-11-29T10:05:00||elastic|pearl-r1-el0002|N/A|UNLIMITED\n"
        "103|PENDING|Resources|N/A|(null)|elastic|pearl-r1-el0003|N/A|10:00\n"
    )
    running, waiting, unknown = parse_squeue(text)
    assert running.nodes == ("dev-h20-1", "dev-h20-2") and running.reason is None
    assert running.start == datetime(2026, 11, 29, 10, 0)
    assert running.end == datetime(2026, 11, 29, 11, 0) and running.time_limit_s == 3600
    assert waiting.time_limit_s is None
    assert waiting.reason == "Priority" and waiting.nodes == ()
    assert unknown.start is None and unknown.name == "pearl-r1-el0003"


def test_bad_output_names_the_line_and_field() -> None:
    with pytest.raises(SlurmTextError, match="line 3: JobID"):
        parse_sacct("JobID|State\n1|COMPLETED\nabc|FAILED\n")
    with pytest.raises(SlurmTextError, match="line 2: 1 fields, the header has 2"):
        parse_sacct("JobID|State\nonly\n")
    with pytest.raises(SlurmTextError, match="line 1: header has no JobID"):
        parse_sacct("Job|Status\n1|X\n")
    with pytest.raises(SlurmTextError, match="line 1: time"):
        parse_squeue("1|PENDING|None|tomorrow||p|n|N/A|10:00\n")
    assert parse_sacct("") == []


def test_restarts_come_from_scontrol_show_job() -> None:
    from pearl.cluster.slurm_text import parse_restarts

    text = "JobId=2 JobName=job.sh\n   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0\n"
    assert parse_restarts(text) == 1
    with pytest.raises(SlurmTextError, match="no Restarts= field"):
        parse_restarts("JobId=2 JobName=job.sh")


def test_a_preemption_shows_in_scontrol_show_job() -> None:
    from pearl.cluster.slurm_text import preempted

    assert preempted(
        "JobId=2 PreemptEligibleTime=2026-12-02T13:36:00 PreemptTime=2026-12-02T13:40:01"
    )
    assert not preempted("JobId=2 PreemptEligibleTime=2026-12-02T13:36:00 PreemptTime=None")
    assert not preempted("JobId=2")
