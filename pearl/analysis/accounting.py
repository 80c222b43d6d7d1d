"""Slurm accounting of a pearl run: per-job records from ``sacct`` and what they cost.

    python analysis/accounting.py FILE_OR_- [--json]   (or python -m pearl.analysis.accounting)

Parsing is pure (text in, records out); ``query_sacct`` is the only function that runs a
command. Row syntax (job ids, states, durations, times) is ``pearl.cluster.slurm_text``'s;
this module folds the rows into jobs and sums them up.

Invariants:
- One ``JobRecord`` per allocation row of ``sacct --parsable2`` (or tab-separated) output:
  a job, an array task (``123_4``), a pending array range (``123_[4-9]``, one record) or a
  heterogeneous component (``123+1``). Steps (``123.batch``, ``123+1.0``) are never
  records: each is folded into the latest record of its job (its count only); a step
  whose job has no row is an orphan, counted.
- ``sacct --duplicates`` prints every incarnation of a requeued job: a row whose job was
  seen before is a new record with ``incarnation`` one higher.
- A malformed row (field count, job id, time, duration, number) is skipped and counted
  with its line number, never raised; only input without a usable header raises
  ``SlurmTextError``.
- States keep their first word (``CANCELLED by 0`` is ``CANCELLED``); a state Slurm does
  not document is kept as it is and counted apart.
- Times are Slurm's naive local times; ``queue_wait_s = start - submit``,
  ``run_s`` = ``ElapsedRaw``, else ``Elapsed``, else ``end - start``;
  ``gpu_hours = gpus * run_s / 3600`` with the GPUs allocated (``AllocTRES``, then
  ``AllocGRES``), else requested (``ReqTRES``, ``ReqGRES``). A job that never got a node
  (``NodeList`` "None assigned") has no start, whatever ``Start`` says.
- The NREL Eagle sample (``job_id,...,submit_time,start_time,end_time,run_time,state``) maps
  onto the same records; its rows that share a job id are array tasks whose index the
  sample dropped, so each row is a job (incarnation 0).
- Roles: ``coordinator`` (``pearl-coordinator-*``, ``launch/submit.py``), ``base``
  (``pearl-base``, ``slurm/base-job.sbatch``), ``elastic`` (``pearl-RUN-elN`` or a pearl
  comment, ``pearl.cluster.submission``), else ``other``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pearl.cluster import slurm_text
from pearl.cluster.slurm_text import (
    SacctRow,
    SlurmTextError,
    parse_job_id,
    parse_time,
)
from pearl.cluster.submission import run_of_comment
from pearl.core.execution import ELASTIC_ID_PREFIX

Role = Literal["coordinator", "base", "elastic", "other"]
JobKey = tuple[int, str | None, int | None]  # (job, array task, het component)

COORDINATOR_PREFIX = "pearl-coordinator-"  # launch/submit.py: pearl-coordinator-<config stem>
BASE_JOB_NAME = "pearl-base"  # slurm/base-job.sbatch: --job-name
# Submission.job_name of an elastic allocation: pearl-RUN-<AllocationIds id>
_ELASTIC_NAME = re.compile(rf"^pearl-.+-{ELASTIC_ID_PREFIX}\d+$")
KNOWN_STATES = frozenset(
    {
        "BOOT_FAIL", "CANCELLED", "COMPLETED", "COMPLETING", "CONFIGURING", "DEADLINE",
        "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PENDING", "PREEMPTED", "REQUEUED",
        "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "RESV_DEL_HOLD", "REVOKED", "RUNNING",
        "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT", "STOPPED", "SUSPENDED", "TIMEOUT",
    }
)  # fmt: skip
SACCT_COLUMNS = (
    "JobID,JobName,Partition,State,Submit,Eligible,Start,End,Elapsed,ElapsedRaw,"
    "AllocTRES,ReqTRES,NNodes,NodeList,Comment,ExitCode"
)
EAGLE_COLUMNS = ("job_id", "partition", "submit_time", "start_time", "end_time", "state")
_MAX_EXAMPLES = 5  # skipped rows quoted in AccountingData.skipped_examples


@dataclass(frozen=True)
class JobRecord:
    job_id: str  # as Slurm prints it, without a step: "123", "123_4", "123_[4-9]", "123+1"
    base_job_id: int
    array_task: str | None  # "4", or a pending range "[4-9]"
    het_component: int | None
    incarnation: int  # 0, then one more for each earlier row of the same job (sacct -D)
    name: str
    partition: str
    role: Role
    state: str
    submit: datetime | None
    eligible: datetime | None
    start: datetime | None
    end: datetime | None
    queue_wait_s: float | None  # start - submit; None when not started
    run_s: float | None
    gpus: int
    gpu_hours: float
    num_nodes: int | None
    restarts: int  # the Restarts column where there is one, else 0
    array_tasks: int  # tasks the row stands for: a pending range's size, else 1
    steps: int  # step rows folded into this record

    @property
    def key(self) -> JobKey:
        return (self.base_job_id, self.array_task, self.het_component)


@dataclass(frozen=True)
class AccountingData:
    source: str
    records: tuple[JobRecord, ...]
    orphan_steps: int  # step rows whose job has no row
    skipped_rows: int
    skipped_examples: tuple[str, ...]  # the first few, "line N: problem"


class SacctUnavailable(RuntimeError):
    pass


# --- pure parsing ---------------------------------------------------------------------


def parse_accounting(text: str, source: str = "<input>") -> AccountingData:
    """The Eagle CSV sample when its header says so, else ``sacct`` output."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if set(EAGLE_COLUMNS) <= set(first.strip().split(",")):
        return parse_eagle_csv(text, source)
    return parse_sacct(text, source)


def parse_sacct(text: str, source: str = "<sacct>") -> AccountingData:
    """Records of ``sacct --parsable2`` (or tab-separated) output with its header line."""
    lines = [(n, ln) for n, ln in enumerate(text.splitlines(), start=1) if ln.strip()]
    if not lines:
        return AccountingData(source, (), 0, 0, ())
    header = lines[0][1]
    slurm_text.parse_sacct(header)  # raises on a header without JobID or State
    builder = _Builder(source)
    for number, line in lines[1:]:
        if line == header:
            continue  # concatenated outputs repeat it
        try:
            (row,) = slurm_text.parse_sacct(f"{header}\n{line}")
            builder.add_sacct_row(row)
        except SlurmTextError as err:
            builder.skip(number, str(err).removeprefix("line 2: "))
    return builder.data()


def parse_eagle_csv(text: str, source: str = "<eagle>") -> AccountingData:
    """Records of the NREL Eagle job sample (``eagle-jobs``'s ``sample_eagle_data.csv``)."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in EAGLE_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise SlurmTextError(f"line 1: the header has no {', '.join(missing)} column")
    builder = _Builder(source)
    for row in reader:
        try:
            builder.add(_record_of_eagle(row))
        except SlurmTextError as err:
            builder.skip(reader.line_num, str(err))
    return builder.data()


def normalise_state(state: str) -> str:
    """``CANCELLED by 0`` -> ``CANCELLED``; ``CANCELLED+`` (a cut-off column) -> ``CANCELLED``."""
    return state.strip().split(" ", 1)[0].rstrip("+")


def role_of(name: str, comment: str = "") -> Role:
    if name.startswith(COORDINATOR_PREFIX):
        return "coordinator"
    if name == BASE_JOB_NAME:
        return "base"
    if run_of_comment(comment) is not None or _ELASTIC_NAME.match(name):
        return "elastic"
    return "other"


def gpus_of_tres(tres: str) -> int:
    """``gres/gpu=4`` (all types) if present, else the sum of ``gres/gpu:TYPE=N``."""
    untyped: int | None = None
    typed = 0
    for item in tres.split(","):
        name, _, value = item.strip().partition("=")
        if name == "gres/gpu":
            untyped = _count(value, "TRES")
        elif name.startswith("gres/gpu:"):
            typed += _count(value, "TRES")
    return typed if untyped is None else untyped


def gpus_of_gres(gres: str) -> int:
    """``gpu:4``, ``gpu:h100:4(IDX:0-3)``, ``gpu`` (one), summed over the list."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        total += _count(parts[-1], "GRES") if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def array_size(task: str | None) -> int:
    """Tasks one row stands for: ``[1-3,7]`` (also ``[0-9:2]``, ``[1-99%5]``) or one."""
    if task is None or not task.startswith("["):
        return 1
    size = 0
    for part in task.strip("[]").split("%", 1)[0].split(","):
        span, _, step = part.partition(":")
        lo, _, hi = span.partition("-")
        first, last = _count(lo, "array range"), _count(hi or lo, "array range")
        size += len(range(first, last + 1, _count(step or "1", "array range") or 1))
    return size


def _gpus_of_fields(fields: dict[str, str]) -> int:
    for column, parse in (
        ("AllocTRES", gpus_of_tres),
        ("AllocGRES", gpus_of_gres),
        ("ReqTRES", gpus_of_tres),
        ("ReqGRES", gpus_of_gres),
    ):
        text = fields.get(column, "").strip()
        if text:
            return parse(text)
    return 0


def _record_of_sacct(row: SacctRow, incarnation: int) -> JobRecord:
    f = row.fields
    never_ran = f.get("NodeList", "").strip() == "None assigned"
    start = None if never_ran else parse_time(f.get("Start", ""))
    end = parse_time(f.get("End", ""))
    run_s: float | None
    if never_ran:
        run_s = 0.0
    elif f.get("ElapsedRaw", "").strip():
        run_s = float(_count(f["ElapsedRaw"], "ElapsedRaw"))
    else:
        run_s = row.elapsed_s if row.elapsed_s is not None else _seconds_between(start, end)
    nodes = f.get("NNodes", f.get("AllocNodes", "")).strip()
    return _record(
        f["JobID"],
        incarnation=incarnation,
        name=f.get("JobName", ""),
        comment=f.get("Comment", ""),
        partition=f.get("Partition", ""),
        state=row.state,
        submit=parse_time(f.get("Submit", "")),
        eligible=parse_time(f.get("Eligible", "")),
        start=start,
        end=end,
        run_s=run_s,
        gpus=_gpus_of_fields(f),
        num_nodes=_count(nodes, "NNodes") if nodes else None,
        restarts=_count(f.get("Restarts", "").strip() or "0", "Restarts"),
    )


def _record_of_eagle(row: dict[str | Any, str | Any]) -> JobRecord:
    if None in row or None in row.values():
        raise SlurmTextError("the row's field count differs from the header's")
    start, end = parse_time(row["start_time"]), parse_time(row["end_time"])
    run_text = (row.get("run_time") or "").strip()
    nodes = (row.get("nodes_req") or "").strip()
    return _record(
        row["job_id"],
        incarnation=0,
        name=row.get("name") or "",
        comment="",
        partition=row["partition"],
        state=row["state"],
        submit=parse_time(row["submit_time"]),
        eligible=None,
        start=start,
        end=end,
        run_s=_seconds(run_text, "run_time") if run_text else _seconds_between(start, end),
        gpus=_count((row.get("gpus_req") or "0").strip(), "gpus_req"),
        num_nodes=_count(nodes, "nodes_req") if nodes else None,
        restarts=0,
    )


def _record(
    job_id_text: str,
    *,
    incarnation: int,
    name: str,
    comment: str,
    partition: str,
    state: str,
    submit: datetime | None,
    eligible: datetime | None,
    start: datetime | None,
    end: datetime | None,
    run_s: float | None,
    gpus: int,
    num_nodes: int | None,
    restarts: int,
) -> JobRecord:
    """The one place a record is made: the derived fields (wait, GPU-hours, role) are here."""
    job_id = parse_job_id(job_id_text)
    return JobRecord(
        job_id=job_id_text.strip(),
        base_job_id=job_id.job,
        array_task=job_id.array_task,
        het_component=job_id.het_component,
        incarnation=incarnation,
        name=name,
        partition=partition.strip(),
        role=role_of(name, comment),
        state=normalise_state(state),
        submit=submit,
        eligible=eligible,
        start=start,
        end=end,
        queue_wait_s=_seconds_between(submit, start),
        run_s=run_s,
        gpus=gpus,
        gpu_hours=gpus * (run_s or 0.0) / 3600.0,
        num_nodes=num_nodes,
        restarts=restarts,
        array_tasks=array_size(job_id.array_task),
        steps=0,
    )


class _Builder:
    """Records in input order; steps folded into the latest record of their job."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.records: list[JobRecord] = []
        self.latest: dict[JobKey, int] = {}  # job -> index of its latest record
        self.orphan_steps = 0
        self.skipped_rows = 0
        self.skipped_examples: list[str] = []

    def add_sacct_row(self, row: SacctRow) -> None:
        j = row.job_id
        key: JobKey = (j.job, j.array_task, j.het_component)
        index = self.latest.get(key)
        if j.is_step:
            if index is None:
                self.orphan_steps += 1
            else:
                self.records[index] = replace(
                    self.records[index], steps=self.records[index].steps + 1
                )
            return
        incarnation = 0 if index is None else self.records[index].incarnation + 1
        self.add(_record_of_sacct(row, incarnation))

    def add(self, record: JobRecord) -> None:
        self.latest[record.key] = len(self.records)
        self.records.append(record)

    def skip(self, line_number: int, problem: str) -> None:
        self.skipped_rows += 1
        if len(self.skipped_examples) < _MAX_EXAMPLES:
            self.skipped_examples.append(f"line {line_number}: {problem}")

    def data(self) -> AccountingData:
        return AccountingData(
            self.source,
            tuple(self.records),
            self.orphan_steps,
            self.skipped_rows,
            tuple(self.skipped_examples),
        )


def _seconds_between(first: datetime | None, then: datetime | None) -> float | None:
    return None if first is None or then is None else (then - first).total_seconds()


def _count(text: str, field: str) -> int:
    """A non-negative whole number, or ``SlurmTextError`` naming the field."""
    if not text.strip().isdigit():
        raise SlurmTextError(f"{field}: {text!r} is not a count")
    return int(text)


def _seconds(text: str, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SlurmTextError(f"{field}: {text!r} is not a number of seconds") from None
    if not value >= 0:
        raise SlurmTextError(f"{field}: {text!r} is not a number of seconds")
    return value


# --- summary ------------------------------------------------------------------------


def summarize(data: AccountingData) -> dict[str, Any]:
    """JSON-serialisable figures: jobs, states, waits, run times, GPU-hours, preemptions."""
    records = data.records
    jobs = [r for r in records if r.incarnation == 0 and r.het_component in (None, 0)]
    states = Counter(r.state for r in records)
    preempted = [r for r in records if r.state == "PREEMPTED"]
    requeues = _requeues_by_job(records)
    return {
        "source": data.source,
        "jobs": len(jobs),  # het components and incarnations count once
        "records": len(records),
        "tasks_in_pending_array_ranges": sum(
            r.array_tasks for r in records if (r.array_task or "").startswith("[")
        ),
        "steps": sum(r.steps for r in records),
        "orphan_steps": data.orphan_steps,
        "skipped_rows": data.skipped_rows,
        "skipped_examples": list(data.skipped_examples),
        "states": dict(sorted(states.items())),
        "unknown_states": {s: n for s, n in sorted(states.items()) if s not in KNOWN_STATES},
        "roles": dict(sorted(Counter(r.role for r in jobs).items())),
        "queue_wait_s": _stats_s(r.queue_wait_s for r in records),
        "run_s": _stats_s(r.run_s for r in records),
        "gpu_hours": {
            "total": sum(r.gpu_hours for r in records),
            "by_partition": _gpu_hours_by(records, lambda r: r.partition or "(none)"),
            "by_role": _gpu_hours_by(records, lambda r: r.role),
        },
        "preemptions": {
            "count": len(preempted),
            "gpu_hours": sum(r.gpu_hours for r in preempted),  # held by the jobs until taken
        },
        "requeues": {
            "count": sum(requeues.values()),
            "jobs": sum(1 for n in requeues.values() if n > 0),
            "records_in_state_requeued": states.get("REQUEUED", 0),
        },
    }


def _requeues_by_job(records: Iterable[JobRecord]) -> dict[JobKey, int]:
    """Per job: its Restarts count or its earlier incarnations (sacct -D), the larger."""
    out: dict[JobKey, int] = defaultdict(int)
    for r in records:
        out[r.key] = max(out[r.key], r.restarts, r.incarnation)
    return out


def _gpu_hours_by(
    records: Iterable[JobRecord], group: Callable[[JobRecord], str]
) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for r in records:
        out[group(r)] += r.gpu_hours
    return dict(sorted(out.items()))


def _stats_s(values: Iterable[float | None]) -> dict[str, float | int | None]:
    known = np.array([v for v in values if v is not None], dtype=np.float64)
    if known.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "max": None}
    return {
        "n": int(known.size),
        "mean": float(known.mean()),
        "p50": float(np.percentile(known, 50)),
        "p90": float(np.percentile(known, 90)),
        "max": float(known.max()),
    }


# --- sacct ----------------------------------------------------------------------------


def query_sacct(
    run_id: str | None,
    job_ids: Sequence[str] | None,
    sacct: str = "sacct",
    since: str = "now-30days",
) -> str:
    """``sacct`` output for the run's jobs (steps and incarnations included), as text.

    One query over the current user's jobs since ``since``; kept: the jobs named
    ``pearl-RUN-*`` and the jobs in ``job_ids`` (the coordinator's and the base job's,
    whose names do not carry the run id), each with its steps. Neither given: all.
    """
    exe = shutil.which(sacct)
    if exe is None:
        raise SacctUnavailable(
            f"{sacct}: not found; run this on a Slurm login node, or save "
            f"`sacct --parsable2 --format={SACCT_COLUMNS}` output and pass the file"
        )
    cmd = [exe, "--parsable2", "--duplicates", f"--format={SACCT_COLUMNS}", "-S", since]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SacctUnavailable(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    if run_id is None and not job_ids:
        return done.stdout
    return select_jobs(done.stdout, f"pearl-{run_id}-" if run_id else None, job_ids or ())


def select_jobs(text: str, name_prefix: str | None, job_ids: Sequence[str]) -> str:
    """The header and the rows (steps included) of the jobs named ``name_prefix*`` or listed.

    A row whose job id does not parse, or whose field count is wrong, is dropped.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return text
    sep = "\t" if "\t" in lines[0] else "|"
    header = lines[0].split(sep)
    name_at = header.index("JobName") if "JobName" in header else None
    id_at = header.index("JobID")
    wanted = {parse_job_id(j).job for j in job_ids}
    kept: list[tuple[int, str]] = []
    for line in lines[1:]:
        values = line.split(sep)
        try:
            job_id = parse_job_id(values[id_at]) if len(values) == len(header) else None
        except SlurmTextError:
            job_id = None
        if job_id is None:
            continue
        named = name_at is not None and name_prefix and values[name_at].startswith(name_prefix)
        if named and not job_id.is_step:
            wanted.add(job_id.job)
        kept.append((job_id.job, line))
    return "\n".join([lines[0], *(line for job, line in kept if job in wanted)]) + "\n"


# --- command line ---------------------------------------------------------------------


def format_table(summary: dict[str, Any]) -> str:
    """A few lines for a person; ``--json`` has everything."""

    def stats(s: dict[str, Any]) -> str:
        if not s["n"]:
            return "n=0"
        return (
            f"n={s['n']} mean={s['mean']:.0f} p50={s['p50']:.0f} "
            f"p90={s['p90']:.0f} max={s['max']:.0f}"
        )

    def pairs(d: dict[str, Any], fmt: str = "{}") -> str:
        return ", ".join(f"{k} {fmt.format(v)}" for k, v in d.items()) or "-"

    g, p, q = summary["gpu_hours"], summary["preemptions"], summary["requeues"]
    lines = [
        f"source: {summary['source']}",
        f"jobs: {summary['jobs']} (records {summary['records']}, steps {summary['steps']}, "
        f"orphan steps {summary['orphan_steps']}, skipped rows {summary['skipped_rows']}, "
        f"tasks in pending array ranges {summary['tasks_in_pending_array_ranges']})",
        f"states: {pairs(summary['states'])}",
        f"unknown states: {pairs(summary['unknown_states'])}",
        f"roles: {pairs(summary['roles'])}",
        f"queue wait s: {stats(summary['queue_wait_s'])}",
        f"run s: {stats(summary['run_s'])}",
        f"GPU-hours: {g['total']:.2f}; by partition: {pairs(g['by_partition'], '{:.2f}')}; "
        f"by role: {pairs(g['by_role'], '{:.2f}')}",
        f"preemptions: {p['count']} (their jobs held {p['gpu_hours']:.2f} GPU-h); "
        f"requeues: {q['count']} in {q['jobs']} jobs",
        *(f"skipped {example}" for example in summary["skipped_examples"]),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python analysis/accounting.py", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("file", help="sacct --parsable2 output, or the Eagle CSV sample; - for stdin")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    name = "<stdin>" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
        summary = summarize(parse_accounting(text, name))
    except OSError as err:
        print(f"{name}: {err.strerror or err}", file=sys.stderr)
        return 2
    except (UnicodeDecodeError, SlurmTextError) as err:
        print(f"{name}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
